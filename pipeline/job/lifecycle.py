"""The job: four steps over one context, any number of times until every partition is committed.

  plan     (once per job):        read -> validate -> content hash -> route -> item keys -> cluster
                                  -> partitions registered, job `planned`                     (plan.py)
  prepare  (per partition):       look up paid items -> render, tokenise -> wave 0 work units (prepare.py)
  drain    (per tier worker):     claim the tier's units of every partition -> engine -> items (drain.py)
  commit   (per partition):       claim -> assemble with the engines' held time shared in -> write
                                  -> commit                                                (commit.py)
  finish:                         every partition succeeded -> manifest; otherwise the job fails, naming them

`run_job` is the entry point of `tokenmill run`: `Job.run` calls the steps in order in one process.
Orchestrators call the same steps one task at a time (job/orchestrate.py). Each step takes the job's
context (context.py), keeps the accounting invariant, and records progress in the state catalog, so
that a rerun (or a second worker) picks up exactly what is not done and pays for nothing twice.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from sqlalchemy.exc import OperationalError

from pipeline.config import TokenmillConfig
from pipeline.config.env import scrub
from pipeline.errors import JobError
from pipeline.generate import metrics
from pipeline.generate.engine import EnginePool
from pipeline.job.commit import commit_ready, commit_stopped
from pipeline.job.context import JobContext, new_job_id
from pipeline.job.drain import drain
from pipeline.job.manifest import refresh_manifest
from pipeline.job.plan import plan
from pipeline.job.prepare import check_budget, expected_engine_seconds, prepare_or_fail
from pipeline.job.progress import Progress
from pipeline.output.manifest import Manifest
from pipeline.plan.estimate import Demand
from pipeline.status import AT_BUDGET_CAP, JobStatus
from pipeline.stores import storage
from pipeline.stores.catalog import StateError, StateStore, migrate, now

log = logging.getLogger(__name__)


@dataclass
class JobResult:
    job_id: str
    manifest: Manifest  # manifest.json as written (`Manifest.as_json` gives its JSON)


def run_job(
    config: TokenmillConfig,
    job_id: str | None = None,
    pool: EnginePool | None = None,
    progress: Progress | None = None,
    partitions: list[str] | None = None,
    worker: str | None = None,
    release_engines: bool = False,
) -> JobResult:
    """Run (or continue) a job until every partition is committed. Raises JobError with a one-line reason.

    `partitions` names partitions to run again even if they succeeded (a no-op that costs nothing,
    since their items are already paid for); otherwise pending, failed and abandoned ones run.
    """
    try:
        job = Job.open(config, job_id or new_job_id(), pool, progress, worker)
        return job.run(partitions or [], release_engines)
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
    """A job run in this process: its context and the four steps in order."""

    def __init__(self, ctx: JobContext):
        self.ctx = ctx

    @classmethod
    def open(
        cls,
        config: TokenmillConfig,
        job_id: str,
        pool: EnginePool | None = None,
        progress: Progress | None = None,
        worker: str | None = None,
    ) -> Job:
        """The job in this process; its catalog brought to the latest schema first, once per process."""
        migrate(config.state.url, once=True)
        return cls(JobContext.open(config, job_id, pool, progress, worker))

    def run(self, forced: list[str], release_engines: bool = False) -> JobResult:
        """Plan if needed; prepare every partition left (and `forced` ones); drain each tier, tiers that
        escalate into another first; commit every generated partition, draining again while partitions
        wait on units this process can run (a dead worker's); finish."""
        ctx = self.ctx
        plan(ctx.planning())
        partitions = ctx.state.partitions(ctx.job_id)
        unknown = sorted(set(forced) - {p.partition for p in partitions})
        if unknown:
            raise JobError(f"job {ctx.job_id} has no partition {', '.join(unknown)}")
        to_run = [p for p in partitions if p.status != "succeeded" or p.partition in forced]
        if ctx.config.budget.active:
            check_budget(ctx.preparing(), [p.partition for p in to_run])
        ctx.state.set_job(ctx.job_id, status="running", started_at=now(), finished_at=None, error=None)
        ctx.progress.start(sum(p.records for p in to_run))
        tried: set[str] = set()
        announced: set[tuple] = set()
        try:
            self.prepare(to_run, forced)
            while True:  # each step built anew: a cache that became unreachable meanwhile is bypassed from then on
                for tier in ctx.drain_order():
                    drain(ctx.draining(), tier, release=release_engines)
                if commit_ready(ctx.committing(), forced, tried, announced) == "done":
                    break
        finally:
            ctx.progress.finish()
            metrics.expect_end(None)
            metrics.report_job(ctx)  # the job's final totals; it is over: no stale expected end
        return self.finish()

    def prepare(self, to_run: list, forced: list[str]) -> None:
        """Prepare the partitions to run; when the run is watched (docs/ops.md), its expected end: now plus the
        high end of the estimate of what it prepared."""
        ctx = self.ctx
        preparing = ctx.preparing()
        demand = Demand() if ctx.config.metrics.serving or ctx.config.metrics.pushgateway_url else None
        for p in to_run:
            if p.status != "running" or p.partition in forced:
                prepare_or_fail(preparing, p.partition, demand)
        if demand is not None:
            try:
                metrics.expect_end(time.time() + expected_engine_seconds(preparing, demand))
            except Exception as e:  # no estimate is no reason to stop a job
                log.warning("no expected end for job %s: %s: %s", ctx.job_id, type(e).__name__, e)

    def end_stopped(self, status: JobStatus, detail: str, reason: str | None = None) -> list:
        """End a job stopped for good (`cancelled` or `expired`, as its batch, or `refused` at a budget cap; none
        of its workers runs): every partition not committed is committed with what it has (commit.commit_stopped),
        the records it had not answered quarantined as `reason` (default: `status`) with `detail`; then the
        job's status is `status` (`failed`, raising JobError, when the tables refuse a partition: `write_manifest`;
        a job `refused` or `deferred` at a budget cap keeps that status and its error, so its batch still reads
        the cap). Returns the partitions that could not be committed yet (held by a worker whose lease runs, or
        failed: each says why), with the job's status unchanged: call again."""
        ctx = self.ctx
        left = commit_stopped(ctx.committing(), reason or status, detail)
        if left:
            return [p for p in ctx.state.partitions(ctx.job_id) if p.partition in left]
        manifest = self.write_manifest(keeping=AT_BUDGET_CAP)
        counts = manifest.job_counts().as_json()
        ctx.state.set_job(ctx.job_id, status=status, finished_at=now(), error=detail, counts=counts)
        return []

    def write_manifest(self, keeping: tuple[JobStatus, ...] = ()) -> Manifest:
        """The job's manifest, written once every committed partition is in the tables; a store that refuses
        one fails the job with the error naming them (failed until a run, or a later end, publishes them),
        unless its status is one of `keeping`: that status stays, and the JobError names them all the same."""
        ctx = self.ctx
        try:
            return refresh_manifest(ctx.manifests())
        except storage.StorageError as e:
            job = ctx.state.job(ctx.job_id)
            if job is None or job.status not in keeping:
                ctx.state.set_job(ctx.job_id, status="failed", finished_at=now(), error=str(e))
            raise JobError(str(e)) from e

    # -- finish -----------------------------------------------------------------------------------
    def finish(self) -> JobResult:
        ctx = self.ctx
        parts = ctx.state.partitions(ctx.job_id)
        unfinished = [p for p in parts if p.status != "succeeded"]
        manifest = self.write_manifest()
        deferred = [p for p in unfinished if p.status == "deferred"]
        counts = manifest.job_counts().as_json()
        if unfinished and len(deferred) == len(unfinished):
            reason = (
                f"budget reached: {len(deferred)} of {len(parts)} partitions ({sum(p.records for p in deferred)} "
                f"records) deferred, nothing lost: {deferred[0].last_error}. Raise the cap (budget.*), then: "
                f"tokenmill rerun --job-id {ctx.job_id}"
            )
            ctx.state.set_job(ctx.job_id, status="deferred", finished_at=now(), error=reason, counts=counts)
            raise JobError(reason, budget=True)
        if unfinished:
            detail = "; ".join(
                f"{p.partition} ({p.file}): {p.status}" + (f": {p.last_error}" if p.last_error else "")
                for p in unfinished[:5]
            )
            error = f"{len(unfinished)} of {len(parts)} partitions not committed: {detail}"
            ctx.state.set_job(ctx.job_id, status="failed", finished_at=now(), error=error, counts=counts)
            raise JobError(f"{error}. Rerun with: tokenmill rerun --job-id {ctx.job_id}")
        ctx.state.set_job(ctx.job_id, status="succeeded", finished_at=now(), counts=counts)
        return JobResult(ctx.job_id, manifest)
