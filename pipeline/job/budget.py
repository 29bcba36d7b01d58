"""The budget guard: hard USD caps checked before a job starts and before every engine call.

Before any GPU work, what the job has spent plus the estimate of what is left must stay under every
cap (job and per tenant), or the job is refused. While it runs, an engine call is admitted only if
spent + that call's estimate stays under; otherwise its partition is deferred (nothing lost, nothing
paid twice: a rerun with a higher cap goes on where it stopped). `spent` is shared with the call
recorders, which add what each call cost.
"""

from __future__ import annotations

from collections.abc import Iterable

import pyarrow as pa

from pipeline.config import TokenmillConfig
from pipeline.errors import JobError
from pipeline.plan.estimate import budget_problems, with_estimates
from pipeline.plan.rates import tier_rates
from pipeline.stores.catalog import StateStore


class BudgetGuard:
    def __init__(self, config: TokenmillConfig, state: StateStore, job_id: str):
        self.config, self.state, self.job_id = config, state, job_id
        self.spent: dict[str, float] = {}  # USD paid so far in this job, per tenant
        self.reason = ""                   # why the last call was refused
        self._rates = None

    @property
    def active(self) -> bool:
        return self.config.budget.active

    def rates(self) -> dict:
        if self._rates is None:
            self._rates = tier_rates(self.config, self.config.output.uri)
        return self._rates

    def admit(self, batch: pa.Table, tenant_of: dict[str, str]) -> bool:
        """Budget admission of one engine call: spent so far + its estimate must stay under every cap."""
        if not self.active:
            return True
        planned = with_estimates(self.spent, batch, tenant_of, self.config, self.rates())
        problems = budget_problems(self.config, sum(planned.values()), planned)
        if problems:
            self.reason = "; ".join(problems)
        return not problems

    def check_start(self, unpaid: Iterable[tuple[pa.Table, pa.Table]]) -> None:
        """Refuse the job (status `refused`) when spent + the estimate of what is left crosses a cap.

        `unpaid`: (units, requests) of every partition still to run, before any GPU work.
        """
        c = self.config
        self.spent = self.state.spent_by_tenant(self.job_id, {n: t.price_per_gpu_hour for n, t in c.tiers.items()})
        planned = dict(self.spent)
        for units, requests in unpaid:
            tenant_of = dict(zip(units["id"].to_pylist(), units["tenant"].to_pylist()))
            planned = with_estimates(planned, requests, tenant_of, c, self.rates())
        problems = budget_problems(c, sum(planned.values()), planned)
        if problems:
            reason = (f"refused before any GPU work: estimated {'; '.join(problems)} "
                      f"({', '.join(sorted({r.method for r in self.rates().values()}))})")
            self.state.set_job(self.job_id, status="refused", error=reason)
            raise JobError(reason, budget=True)
