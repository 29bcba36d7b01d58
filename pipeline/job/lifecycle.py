"""The job: stage its input once, then run its partitions, each committed whole, any number of times.

  staging (once per job):  read -> validate -> content hash -> route -> item keys -> cluster -> records staged
  prepare (per partition): look up paid items -> render, tokenise -> wave 0 work units      (partition.py)
  drain (per tier worker): claim units of its tier from every partition -> engine -> items   (generation.py)
  commit (per partition):  claim -> assemble with the engines' held time shared in -> write -> commit
  finish:                  every partition succeeded -> manifest; otherwise the job fails, naming them

`run_job` is the entry point of `tokenmill run`; orchestrators call the `Job` methods one task at a
time (job/orchestrate.py). The job owns no stage logic: it wires the stages, keeps the accounting
invariant, and records progress in the state catalog so that a rerun (or a second worker) picks up
exactly what is not done and pays for nothing twice.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import secrets
import time
from dataclasses import dataclass
from datetime import datetime, timezone

from sqlalchemy.exc import OperationalError

from pipeline.config import TokenmillConfig
from pipeline.config_env import scrub
from pipeline.generate.adapters import adapter_problems
from pipeline.generate.engine import EnginePool
from pipeline.generate.engine_api import EngineStartError
from pipeline.generate.levers import config_lever_problems
from pipeline.generate.lookup import ItemLookup
from pipeline.job.budget import BudgetGuard
from pipeline.job.errors import JobError
from pipeline.job.generation import Generation
from pipeline.job.manifest import build_manifest
from pipeline.job.partition import PartitionRun
from pipeline.job.progress import Progress
from pipeline.job.staging import StagingArea, ensure_staged
from pipeline.output.commit import publish, published_commit
from pipeline.output.write import write_manifest
from pipeline.stores import storage
from pipeline.stores.cache import ResilientStore, open_store
from pipeline.stores.catalog import StateError, StateStore, aware, default_worker, now
from pipeline.stores.units import worker_is_gone

log = logging.getLogger(__name__)
JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
RUNNABLE = ("pending", "failed", "running", "deferred")  # partition statuses a run tries


@dataclass
class JobResult:
    job_id: str
    manifest: dict


def check_job_id(job_id: str) -> None:
    if not JOB_ID.match(job_id):
        raise JobError(f"job id {job_id!r} must be 1-128 characters of letters, digits, '.', '_' or '-'")


def new_job_id() -> str:
    return f"job-{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}-{secrets.token_hex(3)}"


def utc(t: datetime | None) -> str:
    return "never" if t is None else f"{aware(t).astimezone(timezone.utc):%Y-%m-%d %H:%M:%S} UTC"


def run_job(config: TokenmillConfig, job_id: str | None = None, pool: EnginePool | None = None,
            progress: Progress | None = None, partitions: list[str] | None = None,
            worker: str | None = None, release_engines: bool = False) -> JobResult:
    """Run (or continue) a job until every partition is committed. Raises JobError with a one-line reason.

    `partitions` names partitions to run again even if they succeeded (a no-op that costs nothing,
    since their items are already paid for); otherwise pending, failed and abandoned ones run.
    """
    try:
        return Job.open(config, job_id or new_job_id(), pool, progress, worker).run(partitions or [], release_engines)
    except JobError:
        raise
    except (storage.StorageError, StateError) as e:
        raise JobError(str(e)) from e
    except OperationalError as e:
        # Leases make this safe: what this worker held is claimable again once its lease runs out.
        detail = scrub(str(e.orig).splitlines()[0] if e.orig and str(e.orig) else str(e), config.state.url)
        raise JobError(f"state database {StateStore.safe_url(config.state.url)} unreachable: {detail}") from e
    except Exception as e:
        raise JobError(f"{type(e).__name__}: {e}") from e


class Job:
    def __init__(self, config: TokenmillConfig, job_id: str, state: StateStore, pool: EnginePool,
                 progress: Progress, worker: str):
        check_job_id(job_id)
        if pool.adapters != config.tier_adapters():
            raise JobError(f"the engine pool serves adapters {pool.adapters}, the config's tenants need "
                           f"{config.tier_adapters()}: build it as EnginePool(config.tiers, adapters=config.tier_adapters())")
        self.config, self.job_id, self.state, self.pool, self.progress, self.worker = \
            config, job_id, state, pool, progress, worker
        self.out = storage.resolve(config.output.uri, config.storage)
        self.staging = StagingArea(self.out, job_id)
        self.budget = BudgetGuard(config, state, job_id)
        self._cache: ResilientStore | None = None
        self.announced: set[tuple] = set()  # (partition, holder, lease end) already said to be waited for
        self.release_engines = False  # shut each tier's engine down when its drain ends (run())

    @classmethod
    def open(cls, config: TokenmillConfig, job_id: str, pool: EnginePool | None = None,
             progress: Progress | None = None, worker: str | None = None) -> Job:
        """The job `job_id` on the configured catalog, with defaults for what is not given."""
        check_job_id(job_id)
        return cls(config, job_id, StateStore(config.state.url), pool or EnginePool(config.tiers, adapters=config.tier_adapters()),
                   progress or Progress("off"), worker or default_worker())

    @property
    def cache(self) -> ResilientStore:
        if self._cache is None:
            self._cache = open_store(self.config.cache)
        return self._cache

    @functools.cached_property
    def generation(self) -> Generation:
        return Generation(self)

    @functools.cached_property
    def lookup(self) -> ItemLookup:
        return ItemLookup(self.state, self.cache, self.job_id, self.config.cache.enabled)

    def cache_status(self) -> str:
        return "off" if not self.config.cache.enabled else "bypassed" if self.cache.bypassed else "miss"

    # -- staging ----------------------------------------------------------------------------------
    def check_engines(self, tiers: list[str]) -> None:
        """Before any work on `tiers` (an engine refusing them costs minutes): their levers and their tenants'
        adapters, checked on this host; one JobError naming every problem and its fix."""
        problems = (config_lever_problems({t: self.config.tiers[t] for t in tiers})
                    + adapter_problems(self.config, tiers))
        if problems:
            raise JobError("engines that cannot run: " + "; ".join(problems))

    def ensure_staged(self) -> None:
        """Stage the job unless it is staged already (or wait while another worker stages it); first, check
        every tier's engine (where the GPU tasks run on other hosts, each drain checks its own again)."""
        self.check_engines(list(self.config.tiers))
        ensure_staged(self)

    # -- partitions -------------------------------------------------------------------------------
    def run(self, forced: list[str], release_engines: bool = False) -> JobResult:
        """Stage if needed; prepare every partition left (and `forced` ones); drain each tier with this
        process's worker, tiers that escalate into another first; then commit every generated partition."""
        self.ensure_staged()
        unknown = sorted(set(forced) - {p.partition for p in self.state.partitions(self.job_id)})
        if unknown:
            raise JobError(f"job {self.job_id} has no partition {', '.join(unknown)}")
        to_run = [p for p in self.state.partitions(self.job_id) if p.status != "succeeded" or p.partition in forced]
        if self.budget.active:
            self.check_budget([p.partition for p in to_run])
        self.state.set_job(self.job_id, status="running", started_at=now(), finished_at=None, error=None)
        self.progress.start(sum(p.records for p in to_run))
        self.release_engines = release_engines
        try:
            for p in to_run:
                if p.status != "running" or p.partition in forced:
                    self.prepare_or_fail(p.partition)
            for tier in self.drain_order():
                self.generation.drain(tier, release=release_engines)
            self.commit_all(forced)
        finally:
            self.progress.finish()
        return self.finish()

    def drain_order(self) -> list[str]:
        """Tiers in the order one process drains them: the escalation tier last, since others feed it."""
        last = self.config.escalation_tier
        return sorted(self.config.tiers, key=lambda t: (t == last, t))

    def prepare_or_fail(self, partition: str) -> None:
        try:
            self.prepare_partition(partition)
        except (EngineStartError, StateError, OperationalError):
            raise  # every partition would fail the same way
        except Exception as e:
            reason = str(e) if isinstance(e, storage.StorageError) else f"{type(e).__name__}: {e}"
            log.error("partition %s failed in prepare: %s", partition, reason)
            self.generation.fail(partition, f"prepare: {reason}")

    def commit_all(self, forced: list[str]) -> None:
        """Commit every partition left, waiting for (or taking over from) other workers holding one, or
        still generating one: work units that become claimable meanwhile (a dead worker's) are drained here."""
        tried: set[str] = set()
        while True:
            todo = [p for p in self.state.partitions(self.job_id) if p.partition not in tried
                    and (p.status in RUNNABLE or p.partition in forced)]
            if not todo:
                return
            claimed_any, generating = False, []
            for p in todo:
                if p.generation == "failed":  # failed before the GPU (its prepare): it says why; prepare it again
                    tried.add(p.partition)
                    continue
                if p.generation == "generating" and self.generation.still_generating(p.partition):
                    generating.append(p)
                    continue
                run = PartitionRun(self, p.partition)
                if run.claim(force=p.partition in forced):
                    claimed_any = True
                    tried.add(p.partition)
                    run.run()
            if claimed_any:
                continue
            if generating and (self.generation.release_gone() or self.generation.queue.claimable(self.job_id)):
                for tier in self.drain_order():
                    self.generation.drain(tier, release=self.release_engines)
            elif all(p.status != "running" for p in todo) and not generating:
                return  # only failed partitions this run already tried, or none left
            elif not self.take_over_gone_holders(todo):
                time.sleep(self.config.state.wait_seconds)  # others hold them; their leases tell

    def take_over_gone_holders(self, held: list) -> bool:
        """Release the claims of holders provably gone (True: claim again at once); say who holds the rest.

        After a crash a rerun would otherwise wait out the dead worker's whole lease with nothing on screen."""
        released = False
        for p in held:
            if p.status != "running":
                continue
            if worker_is_gone(p.worker) and self.state.release_gone_holder(self.job_id, p.partition, p.worker):
                log.warning("partition %s: its holder %s is gone (no such process on this host); taking it over "
                            "now instead of at %s", p.partition, p.worker, utc(p.lease_expires_at))
                released = True
            elif (p.partition, p.worker, p.lease_expires_at) not in self.announced:
                self.announced.add((p.partition, p.worker, p.lease_expires_at))
                # Info, not a warning: waiting is normal with several workers; said again as the lease moves.
                log.info("partition %s waits: held by worker %s (last heartbeat %s) until its lease ends at %s "
                         "(database clock), unless it finishes first", p.partition, p.worker,
                         utc(p.heartbeat_at), utc(p.lease_expires_at))
        return released

    def prepare_partition(self, partition: str) -> dict:
        """CPU work ahead of the GPU for one partition (an orchestrator's `prepare` task)."""
        return PartitionRun(self, partition).prepare()

    def drain_tier(self, tier: str) -> dict:
        """One tier worker (an orchestrator's GPU task): drain the tier's units of this job, then free the engine."""
        if tier not in self.config.tiers:
            raise JobError(f"no tier {tier!r} in the config (tiers: {', '.join(self.config.tiers)})")
        self.check_engines([tier])
        report = self.generation.drain(tier, release=True)
        return {"tier": tier, "session": report.session_id, "units": report.units, "requests": report.requests,
                "engine_started": report.started, "startup_seconds": round(report.startup_seconds, 3),
                "busy_seconds": round(report.busy_seconds, 3), "idle_seconds": round(report.idle_seconds, 3)}

    def run_partition(self, partition: str) -> dict:
        """Commit one generated partition (an orchestrator's task): a no-op when it is already committed."""
        p = self.state_partition(partition)
        if p is None:
            raise JobError(f"job {self.job_id} has no partition {partition}")
        if p.generation == "failed" and p.status != "succeeded":
            raise JobError(f"partition {partition}: {p.last_error}")
        if p.status != "succeeded":
            run = PartitionRun(self, partition)
            if not run.claim() and not (worker_is_gone(p.worker)
                                        and self.state.release_gone_holder(self.job_id, partition, p.worker)
                                        and run.claim()):
                raise JobError(f"partition {partition} is held by worker {p.worker} until its lease ends at "
                               f"{utc(p.lease_expires_at)} (database clock); retry later")
            run.run()
        p = self.state_partition(partition)
        if p.status != "succeeded":
            raise JobError(f"partition {partition}: {p.status}: {p.last_error}", budget=p.status == "deferred")
        return {"partition": partition, "status": p.status, "attempts": p.attempts, **json.loads(p.counts or "{}")}

    def check_budget(self, partitions: list[str]) -> None:
        """Refuse to start when spent + the estimate of what is left would cross a cap (before any GPU work)."""
        def unpaid():
            for partition in partitions:
                _, _, units, requests, _ = PartitionRun(self, partition).unpaid_requests(
                    self.staging.read(partition, "records"))
                yield units, requests
        self.budget.check_start(unpaid())

    def state_partition(self, partition: str):
        return next((p for p in self.state.partitions(self.job_id) if p.partition == partition), None)

    # -- finish -----------------------------------------------------------------------------------
    def finish(self) -> JobResult:
        parts = self.state.partitions(self.job_id)
        unfinished = [p for p in parts if p.status != "succeeded"]
        manifest = self.write_manifest()
        deferred = [p for p in unfinished if p.status == "deferred"]
        counts = {**manifest["counts"], "staging": manifest.get("staging", {})}
        if unfinished and len(deferred) == len(unfinished):
            reason = (f"budget reached: {len(deferred)} of {len(parts)} partitions ({sum(p.records for p in deferred)} "
                      f"records) deferred, nothing lost: {deferred[0].last_error}. Raise the cap (budget.*), then: "
                      f"tokenmill rerun --job-id {self.job_id}")
            self.state.set_job(self.job_id, status="deferred", finished_at=now(), error=reason, counts=counts)
            raise JobError(reason, budget=True)
        if unfinished:
            detail = "; ".join(f"{p.partition} ({p.file}): {p.status}" + (f": {p.last_error}" if p.last_error else "")
                               for p in unfinished[:5])
            error = f"{len(unfinished)} of {len(parts)} partitions not committed: {detail}"
            self.state.set_job(self.job_id, status="failed", finished_at=now(), error=error, counts=counts)
            raise JobError(f"{error}. Rerun with: tokenmill rerun --job-id {self.job_id}")
        self.state.set_job(self.job_id, status="succeeded", finished_at=now(), counts=counts)
        return JobResult(self.job_id, manifest)

    def manifest(self, partial: bool) -> dict:
        job = self.state.job(self.job_id)
        counts = json.loads(job.counts or "{}")
        staging = counts.get("staging") or counts.get("plan", {})  # "plan": jobs staged before 0.1 named it so
        return build_manifest(self.config, self.job_id, job, self.state.partitions(self.job_id), partial, staging,
                              self.generation.queue.sessions(self.job_id))

    def write_manifest(self) -> dict:
        """Write and return the manifest over whatever has committed (partial while any partition has not).

        First publishes the commit of any partition whose commit record is missing or names another
        commit than the catalog's (its worker died between the catalog's commit and the record, or an
        older commit's late record overwrote it), so readers see what the catalog committed.
        """
        parts = self.state.partitions(self.job_id)
        for p in parts:
            commit = json.loads(p.counts or "{}").get("commit") if p.status == "succeeded" else None
            if commit and published_commit(self.out, self.job_id, p.partition) != commit["id"]:
                publish(self.out, self.job_id, p.partition, commit["id"], commit["files"])
        manifest = self.manifest(partial=any(p.status != "succeeded" for p in parts))
        write_manifest(self.out, self.job_id, manifest)
        return manifest
