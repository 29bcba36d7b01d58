"""The drain step: one tier worker runs its tier's work units of every partition of a job.

  drain[tier]:  claim units of the tier -> engine (generate/worker.py) -> items stored in the catalog,
                priced against the budget, offered to the cache -> each finished unit advances its
                partition's waves (the next wave may be on another tier)

`TierDrain` is the job's side of the tier worker (worker.JobSide), built with the collaborators it uses. A
drain ends when its tier has no unit left and none can still come; it never commits (the commit step does,
once a partition is generated).
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass

import pyarrow as pa

from pipeline.config import TokenmillConfig
from pipeline.errors import JobError
from pipeline.generate import metrics
from pipeline.generate.engine import EnginePool
from pipeline.generate.partition_waves import PartitionWaves
from pipeline.generate.worker import Failure, TierWorker, WorkerReport
from pipeline.job.budget import BudgetGuard
from pipeline.job.preflight import check_engines, check_isolation
from pipeline.job.progress import Progress
from pipeline.stores.cache import ResilientStore
from pipeline.stores.catalog import ItemsRefused, StateStore
from pipeline.stores.units import UNFINISHED, UnitQueue, WorkUnit

log = logging.getLogger(__name__)

# A GPU worker host names the tiers its GPUs are provisioned for (`small`, or `small,large`): a queue
# misrouted to it (a worker started with the wrong `--queues`) then fails the task at once, naming both,
# instead of loading a model onto a GPU sized for another. Unset: the host serves every tier.
WORKER_TIERS_ENV = "TOKENMILL_WORKER_TIERS"


def check_worker_serves(tier: str) -> None:
    """Raise unless this host may serve `tier` (TOKENMILL_WORKER_TIERS)."""
    serves = [t.strip() for t in os.environ.get(WORKER_TIERS_ENV, "").split(",") if t.strip()]
    if serves and tier not in serves:
        raise JobError(
            f"this worker serves tiers {', '.join(serves)} ({WORKER_TIERS_ENV}); a drain of tier {tier!r} "
            f"reached it: check that its Celery worker consumes only the queues gpu-{' and gpu-'.join(serves)}"
        )


@dataclass(frozen=True)
class Draining:
    """What the drain step uses, and only that (built by the job's context, `JobContext.draining`)."""

    config: TokenmillConfig
    job_id: str
    worker: str  # whose unit claims and engine session
    pool: EnginePool  # the tiers' engines
    state: StateStore  # items stored; the job's row (its isolation)
    queue: UnitQueue  # the job's work units
    waves: PartitionWaves
    budget: BudgetGuard
    progress: Progress
    cache: ResilientStore | None  # None: this job's items are not offered to the cache (off, or unreachable)
    cache_status: str  # recorded on every item: off | bypassed | miss


@dataclass
class TierDrain:
    """What the tier worker of `tier` needs from the job (worker.JobSide): the collaborators it uses, and only
    those, taken from the drain step's by `of`."""

    tier: str
    config: TokenmillConfig
    job_id: str
    state: StateStore  # items stored
    queue: UnitQueue  # charges, key states, the queue's depth
    waves: PartitionWaves  # requests of a unit, next waves, a partition failed
    budget: BudgetGuard  # admission of a unit's requests
    progress: Progress
    cache: ResilientStore | None  # None: this job's items are not offered to the cache (off, or unreachable)
    cache_status: str  # recorded on every item: off | bypassed | miss

    @classmethod
    def of(cls, d: Draining, tier: str) -> TierDrain:
        return cls(tier, d.config, d.job_id, d.state, d.queue, d.waves, d.budget, d.progress, d.cache, d.cache_status)

    def requests(self, unit: WorkUnit) -> list[dict]:
        return self.waves.requests(unit)

    def unit_done(self, unit: WorkUnit) -> None:
        """The unit's keys are in: derive the next wave of every partition that can go on now, its own and
        those waiting on its keys (an item key is owned by the first unit that enqueued it: such a partition
        has no open unit of its own)."""
        waiting = self.queue.partitions_without_open_units(self.job_id)
        for partition in dict.fromkeys([unit.partition, *waiting]):
            self.waves.safely(self.waves.advance, partition)

    def unit_failed(self, unit: WorkUnit, error: str) -> None:
        self.waves.fail(unit.partition, f"generation: {error}")

    def more_may_come(self) -> bool:
        """Units of this tier can still come from the units of the tiers that escalate into it, or whose outputs
        it judges (chunks, reduces and retries stay on their own tier). A question only: the waves move where a
        unit finishes."""
        c = self.config
        feeders = {t for t in c.tiers if t != self.tier} if self.tier in c.fed_tiers else set()
        depth = self.queue.depth(self.job_id)
        return any(depth.get(t, {}).get(s) for t in feeders for s in UNFINISHED)

    def admit(self, unit: WorkUnit, rows: list[dict]) -> bool:
        return self.budget.admit(
            unit,
            pa.table(
                {
                    "item_key": [r["generation"]["item_key"] for r in rows],
                    "tenant": [r["generation"]["tenant"] for r in rows],
                    "tier": [self.tier] * len(rows),
                    "prompt_token_ids": [r["prompt_token_ids"] for r in rows],
                }
            ),
        )

    def store(self, items: dict[str, dict], failed: dict[str, Failure]) -> None:
        if items:
            try:
                self.state.store_items(self.job_id, items)
            except ItemsRefused as e:  # the others are stored (paid, kept); the refused ones fail their partitions
                for key in e.refused:
                    self.waves.fail(items[key]["partition"], f"ItemsRefused: {e}")
                failed = failed | {k: Failure("engine_error", e.refused[k], None, {}) for k in e.refused}
                items = {k: v for k, v in items.items() if k not in e.refused}
        self.queue.add_charges(
            self.job_id,
            [
                {
                    "charge_id": f"{f.unit.unit_id}/{f.unit.epoch}/{key}",
                    "partition": f.unit.partition,
                    "session_id": f.unit.session_id,
                    "kind": "failed_attempt",
                    "id": f.generation.get("record_id", f.generation["id"]),
                    "tenant": f.generation["tenant"],
                    "tier": f.unit.tier,
                    "gpu_seconds": f.gpu_seconds,
                }
                for key, f in failed.items()
                if f.gpu_seconds > 0 and f.unit is not None
            ],
        )
        states = {k: ("done", None, None) for k in items}
        states |= {k: ("failed", f.reason, f.detail) for k, f in failed.items()}
        self.queue.set_keys(self.job_id, states)
        tiers = self.config.tiers
        self.progress.advance(
            usd=sum(i["gpu_seconds"] * tiers[i["tier"]].price_per_gpu_hour / 3600 for i in items.values()),
            stored=Counter(i["partition"] for i in items.values()),
        )

    def cache_put(self, by_scope: dict[str, dict]) -> None:
        if self.cache is not None:
            for scope, values in by_scope.items():
                self.cache.put_many(scope, values)


def release_gone(queue: UnitQueue, job_id: str) -> bool:
    """Make the units of provably gone workers claimable now; True when there were any."""
    gone = queue.release_gone(job_id)
    for unit in gone:
        log.warning(
            "work unit %s: its holder %s is gone (no such process on this host); taking it over now "
            "instead of when its lease ends",
            unit.unit_id,
            unit.worker,
        )
    return bool(gone)


def drain(draining: Draining, tier: str, release: bool = False) -> WorkerReport:
    """Run one tier worker for this job until its tier has no unit left or to come; `release`: shut the
    tier's engine down at the end (this process will not use it again). The process serves its metrics from
    here on (`metrics.port`), and pushes the job's state at the end (`metrics.pushgateway_url`)."""
    metrics.serve(draining.config.metrics)
    metrics.begin(draining.config, draining.job_id)
    release_gone(draining.queue, draining.job_id)
    try:
        return TierWorker(
            draining.config,
            tier,
            draining.job_id,
            draining.queue,
            draining.pool,
            draining.worker,
            TierDrain.of(draining, tier),
            release,
        ).drain()
    finally:
        metrics.report_job(draining)


def drain_tier(draining: Draining, tier: str) -> dict:
    """One tier worker as an orchestrator's GPU task: check the tier's engine on this host, drain, free the
    engine; what the engine's time went to."""
    if tier not in draining.config.tiers:
        raise JobError(f"no tier {tier!r} in the config (tiers: {', '.join(draining.config.tiers)})")
    check_worker_serves(tier)
    check_engines(draining.config, [tier])
    # An adapter retrained since the plan task: its outputs would get the old keys.
    check_isolation(draining.state, draining.job_id, draining.config)
    report = drain(draining, tier, release=True)
    return {
        "tier": tier,
        "worker": draining.worker,  # host:pid of the task process: which worker ran it, in its own words
        "session": report.session_id,
        "units": report.units,
        "requests": report.requests,
        "engine_started": report.started,
        "startup_seconds": round(report.startup_seconds, 3),
        "busy_seconds": round(report.busy_seconds, 3),
        "idle_seconds": round(report.idle_seconds, 3),
    }
