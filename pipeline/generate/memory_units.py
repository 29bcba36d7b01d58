"""Requests run through the tier worker with no job around them: evals and benchmarks generate through the
same engine loop, pricing and output checks as a job (one generation path), with units held in memory
instead of the catalog and the items handed back instead of stored.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from pipeline.config import BudgetConfig, TokenmillConfig
from pipeline.generate.engine import EnginePool
from pipeline.generate.worker import Failure, TierWorker, WorkerReport
from pipeline.stores.lease import default_worker
from pipeline.stores.units import WorkUnit

log = logging.getLogger(__name__)

UNIT_REQUESTS = 256  # requests per in-memory unit: the worker claims units while its batch has room


class MemoryUnits:
    """The unit source a tier worker claims from (stores/units.UnitQueue's part it uses), in memory: one
    process, one worker, so nothing to lease; sessions are not recorded (no ledger to add up)."""

    def __init__(self, units: list[WorkUnit]):
        self.pending = list(units)

    def claim(self, job_id: str, tier: str, worker: str, session_id: str, lease_seconds: float) -> WorkUnit | None:
        for i, unit in enumerate(self.pending):
            if unit.tier == tier:
                unit.session_id, unit.status = session_id, "leased"
                return self.pending.pop(i)
        return None

    def claimable(self, job_id: str, tier: str | None = None) -> int:
        return sum(1 for u in self.pending if tier is None or u.tier == tier)

    def finish(self, job_id: str, unit: WorkUnit, status: str = "done") -> bool:
        unit.status = status
        return True

    def renew(self, job_id: str, session_id: str, lease_seconds: float) -> None:
        pass

    def open_session(self, *args, **kwargs) -> None:
        pass

    def beat_session(self, *args, **kwargs) -> None:
        pass


@dataclass
class Collected:
    """The JobSide of a run with no job: the requests by unit, and what finished (items by key, failures)."""

    rows: dict[str, list[dict]]
    items: dict[str, dict] = field(default_factory=dict)
    failed: dict[str, Failure] = field(default_factory=dict)
    cache_status: str = "off"

    def requests(self, unit: WorkUnit) -> list[dict]:
        return self.rows[unit.unit_id]

    def unit_done(self, unit: WorkUnit) -> None:
        pass

    def unit_failed(self, unit: WorkUnit, error: str) -> None:
        for row in self.rows[unit.unit_id]:
            self.failed[row["generation"]["item_key"]] = Failure("engine_error", error, unit, row["generation"])

    def more_may_come(self) -> bool:
        return False

    def admit(self, unit: WorkUnit, rows: list[dict]) -> bool:
        return True

    def store(self, items: dict[str, dict], failed: dict[str, Failure]) -> None:
        self.items.update(items)
        self.failed.update(failed)

    def cache_put(self, by_scope: dict[str, dict]) -> None:
        pass


def generate(
    rows: list[dict], tier: str, config: TokenmillConfig, pool: EnginePool, run_id: str = "memory"
) -> tuple[Collected, WorkerReport]:
    """Run `rows` (prompt_token_ids, max_tokens, generation: item_key, id, tenant, scope, text) on `tier`'s engine
    through the tier worker; what finished, by item key, and the worker's report (engine seconds)."""
    units, by_unit = [], {}
    for n, start in enumerate(range(0, len(rows), UNIT_REQUESTS)):
        unit = WorkUnit(
            job_id=run_id,
            unit_id=f"{run_id}/{n}/{tier}",
            partition=run_id,
            tier=tier,
            wave=0,
            requests=len(rows[start : start + UNIT_REQUESTS]),
            status="pending",
            epoch=0,
        )
        units.append(unit)
        by_unit[unit.unit_id] = rows[start : start + UNIT_REQUESTS]
    side = Collected(by_unit)
    # No job, so no budget (each unit admitted, the batch kept full) and no tenant (the tier's base model).
    alone = config.model_copy(update={"budget": BudgetConfig(), "tenants": {}})
    worker = TierWorker(alone, tier, run_id, MemoryUnits(units), pool, default_worker(), side)
    return side, worker.drain()
