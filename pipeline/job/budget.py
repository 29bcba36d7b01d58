"""The budget guard: hard USD caps checked before a job starts and before every engine call.

Before any GPU work, what the job has spent plus the estimate of what is left must stay under every
cap (job and per tenant), or the job is refused. While it runs, an engine call is admitted only if
what the job has spent and reserved, plus that call's estimate, stays under; otherwise its partition is
deferred (nothing lost, nothing paid twice: a rerun with a higher cap goes on where it stopped).
Spent and reserved amounts live in the catalog (UnitQueue.reserve), so a cap is one amount for the job,
however many workers, drain tasks and reruns spend it.
"""

from __future__ import annotations

from collections.abc import Iterable

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.config import TokenmillConfig
from pipeline.errors import JobError
from pipeline.generate import metrics
from pipeline.plan.estimate import Demand, budget_problems, estimate_usd, with_estimates, with_priors
from pipeline.plan.rates import tier_rates
from pipeline.stores.catalog import StateStore
from pipeline.stores.units import UnitQueue, WorkUnit


class BudgetGuard:
    def __init__(self, config: TokenmillConfig, state: StateStore, queue: UnitQueue, job_id: str):
        self.config, self.state, self.queue, self.job_id = config, state, queue, job_id
        self.prices = {n: t.price_per_gpu_hour for n, t in config.tiers.items()}
        self.reason = ""  # why the last call was refused
        self._rates = None

    @property
    def active(self) -> bool:
        return self.config.budget.active

    def rates(self) -> dict:
        if self._rates is None:
            self._rates = tier_rates(self.config, self.config.output.uri)
        return self._rates

    def problems(self, tenant_usd: dict[str, float]) -> list[str]:
        return budget_problems(self.config, sum(tenant_usd.values()), tenant_usd)

    def admit(self, unit: WorkUnit, batch: pa.Table) -> bool:
        """Budget admission of one unit's engine calls (`batch`: item_key, tenant, tier, prompt_token_ids):
        reserve their estimate, with their expected escalations, if the job's spent and reserved USD plus
        it crosses no cap."""
        if not self.active:
            return True
        usd = estimate_usd(
            batch["tier"], pc.list_value_length(batch["prompt_token_ids"]), self.config, self.rates(), True
        )
        requests = list(zip(batch["item_key"].to_pylist(), batch["tenant"].to_pylist(), usd))
        problems = self.queue.reserve(self.job_id, unit, requests, self.prices, self.problems)
        if problems:
            self.reason = "; ".join(problems)
        if metrics.wanted(self.config.metrics):
            metrics.budget_left(self.remaining())
        return not problems

    def remaining(self) -> dict[tuple[str, str | None], float]:
        """USD left under each cap, (`job`, None) or (`tenant`, its name): the cap less what the job spent and
        reserved (negative: crossed)."""
        b = self.config.budget
        spent = self.queue.spent(self.job_id, self.prices)
        left: dict[tuple[str, str | None], float] = {}
        if b.max_job_usd is not None:
            left[("job", None)] = b.max_job_usd - sum(spent.values())
        for tenant in sorted(set(spent) | set(b.max_tenant_usd)):
            cap = b.tenant_cap(tenant)
            if cap is not None:
                left[("tenant", tenant)] = cap - spent.get(tenant, 0.0)
        return left

    def check_start(self, unpaid: Iterable[tuple[pa.Table, pa.Table]]) -> None:
        """Refuse the job (status `refused`) when spent + the estimate of what is left crosses a cap.

        `unpaid`: (generations, requests) of every partition still to run, before any GPU work.
        """
        c = self.config
        tiers, prompts, tenants = [], [], []  # per request: what pricing needs, not its token ids
        for generations, requests in unpaid:
            tenant_of = dict(zip(generations["id"].to_pylist(), generations["tenant"].to_pylist()))
            tiers += requests["tier"].to_pylist()
            prompts += pc.list_value_length(requests["prompt_token_ids"]).to_pylist()
            tenants += [tenant_of[i] for i in requests["id"].to_pylist()]
        # A tier with no ledger yet is priced by the hardware projection of its share of these requests, as
        # `tokenmill estimate` prices it (plan/estimate.py with_priors); so do this process's admissions (a drain
        # task of the Airflow DAG, another process, prices such a tier by its configured default until a ledger exists).
        demand = Demand()
        demand.add(tiers, prompts, tenants)
        self._rates = with_priors(c, self.rates(), demand)
        planned = with_estimates(self.queue.spent(self.job_id, self.prices), tiers, prompts, tenants, c, self._rates)
        problems = self.problems(planned)
        if problems:
            reason = (
                f"refused before any GPU work: estimated {'; '.join(problems)} "
                f"({', '.join(sorted({r.method for r in self.rates().values()}))})"
            )
            self.state.set_job(self.job_id, status="refused", error=reason)
            raise JobError(reason, budget=True)
