"""The job context: built once per process and job, it builds each step's collaborators.

A step (plan, prepare, drain, commit, the manifest write) takes a small type of its own that names what it uses
(`Planning`, `Preparing`, `Draining`, `Committing`, `ManifestSources`), and never the context: the context builds
them (`planning()`, `preparing()`, ...). The parts the steps share (the cache connection, the item lookup, the
work-unit queue, the budget guard) open on first use, so a step that does not need the cache never connects to it;
no step replaces a part (the budget guard's running spend is the one figure the drains add to).
"""

from __future__ import annotations

import functools
import re
import secrets
from dataclasses import dataclass
from datetime import datetime, timezone

from pipeline.config import TokenmillConfig
from pipeline.errors import JobError
from pipeline.generate.engine import EnginePool
from pipeline.generate.engine_time import EngineTime
from pipeline.generate.lookup import ItemLookup
from pipeline.generate.partition_waves import PartitionWaves
from pipeline.job import faults
from pipeline.job.budget import BudgetGuard
from pipeline.job.commit import Committing
from pipeline.job.drain import Draining
from pipeline.job.manifest import ManifestSources
from pipeline.job.plan import Planning
from pipeline.job.prepare import Preparing
from pipeline.job.progress import Progress
from pipeline.stores import storage
from pipeline.stores.cache import ResilientStore, open_store
from pipeline.stores.catalog import StateStore
from pipeline.stores.lease import default_worker
from pipeline.stores.staging import StagingArea
from pipeline.stores.units import UnitQueue

JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_job_id(job_id: str) -> None:
    if not JOB_ID.fullmatch(job_id):
        raise JobError(
            f"job id {job_id!r} is not valid: it must be 1-128 characters of letters, digits, '.', '_' or '-'"
        )


def new_job_id() -> str:
    return f"job-{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}-{secrets.token_hex(3)}"


@dataclass(frozen=True)
class JobContext:
    config: TokenmillConfig
    job_id: str
    state: StateStore
    progress: Progress
    worker: str
    given_pool: EnginePool | None = None  # None: `pool` builds the tiers' engines on first use

    @classmethod
    def open(
        cls,
        config: TokenmillConfig,
        job_id: str,
        pool: EnginePool | None = None,
        progress: Progress | None = None,
        worker: str | None = None,
    ) -> JobContext:
        """The job `job_id` on the configured catalog, with defaults for what is not given."""
        check_job_id(job_id)
        if pool is not None and pool.adapters != config.tier_adapters():
            raise JobError(
                f"the engine pool serves adapters {pool.adapters}, the config's tenants need "
                f"{config.tier_adapters()}: build it as EnginePool(config.tiers, adapters=config.tier_adapters())"
            )
        return cls(
            config, job_id, StateStore(config.state.url), progress or Progress("off"), worker or default_worker(), pool
        )

    @functools.cached_property
    def pool(self) -> EnginePool:
        """The tiers' engines and tokenizers, built on first use (a planning task builds none)."""
        return self.given_pool or EnginePool(self.config.tiers, adapters=self.config.tier_adapters())

    # functools.cached_property writes the instance's __dict__ directly, so it works on a frozen dataclass.
    @functools.cached_property
    def out(self) -> storage.Location:
        return storage.resolve(self.config.output.uri, self.config.storage)

    @functools.cached_property
    def staging(self) -> StagingArea:
        return StagingArea(self.out, self.job_id)

    @functools.cached_property
    def cache(self) -> ResilientStore:
        return open_store(self.config.cache)

    @functools.cached_property
    def lookup(self) -> ItemLookup:
        return ItemLookup(self.state, self.cache, self.job_id, self.config.cache.enabled)

    @functools.cached_property
    def queue(self) -> UnitQueue:
        return UnitQueue(self.state)

    @functools.cached_property
    def waves(self) -> PartitionWaves:
        return PartitionWaves(
            self.config,
            self.job_id,
            self.state,
            self.queue,
            self.staging,
            self.lookup,
            self.pool,
            lambda partition: faults.checkpoint("wave_written", self.job_id, partition),
        )

    @functools.cached_property
    def engine_time(self) -> EngineTime:
        return EngineTime(self.config, self.job_id, self.state, self.queue)

    @functools.cached_property
    def budget(self) -> BudgetGuard:
        """Admission of engine calls against the job's caps, from what every worker spent and reserved."""
        return BudgetGuard(self.config, self.state, self.queue, self.job_id)

    def cache_status(self) -> str:
        """What the cache is to this job's new items: off (config), bypassed (unreachable) or miss (in use)."""
        return "off" if not self.config.cache.enabled else "bypassed" if self.cache.bypassed else "miss"

    def manifests(self) -> ManifestSources:
        return ManifestSources(self.config, self.job_id, self.state, self.queue, self.out)

    def planning(self) -> Planning:
        return Planning(
            self.config, self.job_id, self.state, self.worker, self.out, self.staging, self.manifests(),
            self.progress.planning, lambda: self.cache,
        )  # fmt: skip

    def preparing(self) -> Preparing:
        return Preparing(
            self.config, self.job_id, self.staging, self.lookup, self.pool, self.waves, self.budget, self.state,
            self.queue,
        )  # fmt: skip

    def draining(self) -> Draining:
        status = self.cache_status()
        return Draining(
            self.config, self.job_id, self.worker, self.pool, self.state, self.queue, self.waves, self.budget,
            self.progress, self.cache if status == "miss" else None, status,
        )  # fmt: skip

    def committing(self) -> Committing:
        cache = self.cache if self.cache_status() == "miss" else None
        return Committing(
            self.config, self.job_id, self.worker, self.state, self.queue, self.budget, self.waves,
            self.engine_time, self.staging, self.lookup, self.out, cache, self.progress,
        )  # fmt: skip

    def drain_order(self) -> list[str]:
        """Tiers in the order one process drains them: the escalation tier and the judge's last, since others
        feed them (with escalation on, the judge's tier is the escalation tier: config/job.py)."""
        fed = self.config.fed_tiers
        return sorted(self.config.tiers, key=lambda t: (t in fed, t))
