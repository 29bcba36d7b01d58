"""The plan step: the CPU stages over the whole input, once per job, into the staging area.

  plan:  claim the job's planning -> pipeline/plan/ (read, validate, key, route, sketch, cluster;
         streamed by file, sharded by dedup scope) -> the partitions registered in the catalog, job `planned`

A worker that finds the job being planned waits for it (or takes over a planning worker that died); a job
planned already is not planned again. Planning's lease is fenced by its claim's epoch
(jobs.planning_epoch). An orchestrator runs planning as several tasks: keyed_shards claims it,
clustered_shard and planned_from_shards work under the claim current when they start (a task of a
planning taken over since renews, fails and registers nothing), each renewing as its own process.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager

from pipeline.config import redact_url
from pipeline.errors import JobError
from pipeline.job import faults
from pipeline.job.context import JobContext
from pipeline.job.manifest import current_manifest
from pipeline.keys import config_fingerprint, isolation_fingerprint
from pipeline.output.manifest import JobCounts
from pipeline.output.tables import old_layout
from pipeline.output.write import write_manifest
from pipeline.plan.streamed import (
    Plan,
    clustered_plan,
    list_input,
    plan_job,
    plan_keyed,
    plan_shard,
    plan_staged,
    planning_pool,
    planning_workers,
)
from pipeline.status import PLANNING
from pipeline.stores import storage
from pipeline.stores.catalog import utc
from pipeline.stores.lease import Renewal, worker_is_gone

log = logging.getLogger(__name__)
# A gone planning worker (its host:pid process no longer exists) is replaced once it has not renewed for a third of
# the lease, at most this long: an orchestrator's planning tasks each renew as their own process.
GONE_GRACE_SECONDS = 15.0


def plan(ctx: JobContext) -> None:
    """The plan step: check that the output root can be written and every tier's engine on this host (each
    drain checks its own again, where GPU tasks run elsewhere), then plan the job unless it is planned
    already."""
    ctx.check_engines(list(ctx.config.tiers))  # first: a refused config leaves no output folder behind
    ensure_planned(ctx)


def check_output_root(ctx: JobContext) -> None:
    """The output root can be written and is not of the layout before the Delta tables: refused before any
    planning, on every path that plans (`tokenmill run`, the DAG's first task)."""
    try:
        storage.check_writable(ctx.out)
    except storage.StorageError as e:
        raise JobError(f"output root {e}: nothing was run; make it writable or set output.uri") from None
    if old_layout(ctx.out):
        raise JobError(
            f"output root {ctx.out.uri(ctx.out.path)} holds commit records of the layout before Delta tables: "
            f"nothing was run; convert it once with `tokenmill tables migrate --output {ctx.config.output.uri}`"
        )


def ensure_planned(ctx: JobContext, steps=None):
    """Plan the job unless it is planned already (or wait while another worker plans it, saying who and
    until when; a planning worker provably gone is taken over at once).

    `steps(ctx, epoch)` does the planning under the planning claim `epoch` (default: all of planning,
    `plan_input`); its result is returned, or None when the job was planned already."""
    check_output_root(ctx)
    steps = steps or plan_input
    c = ctx.config
    epoch = ctx.state.claim_planning(
        ctx.job_id, config_fingerprint(c), c.input.uri, c.output.uri, ctx.worker, c.state.lease_seconds
    )
    if epoch:
        return steps(ctx, epoch)
    announced = None
    while True:
        row = ctx.state.job(ctx.job_id)
        if row.status not in PLANNING:
            break
        gone = (
            row.planning_worker
            if row.status == "planning" and row.planning_worker and worker_is_gone(row.planning_worker)
            else None
        )
        epoch = ctx.state.reclaim_planning(
            ctx.job_id,
            c.state.lease_seconds,
            ctx.worker,
            gone_worker=gone,
            grace_seconds=min(c.state.lease_seconds / 3, GONE_GRACE_SECONDS),
        )
        if epoch:  # the last planning failed, its worker's lease ran out, or its worker is gone
            if gone:
                log.warning(
                    "job %s: its planning worker %s is gone (no such process on this host); planning it again now "
                    "instead of when its lease ends",
                    ctx.job_id,
                    gone,
                )
            return steps(ctx, epoch)
        if announced != (row.planning_worker, row.planning_epoch):
            announced = (row.planning_worker, row.planning_epoch)
            renewed, ends = row.planning_renewed_at, row.planning_lease_expires_at
            log.info(
                "job %s waits: planned by worker %s (last renewal %s) until its lease ends at %s (database "
                "clock), unless it finishes first",
                ctx.job_id,
                row.planning_worker,
                utc(renewed),
                utc(ends),
            )
        time.sleep(c.state.wait_seconds)
    if row.output_uri != c.output.uri:
        raise JobError(f"job {ctx.job_id} writes to {row.output_uri}, not {c.output.uri}; use that output")
    if row.input_uri != c.input.uri:  # a job id reused for other input (a DAG run's `job_id` param): not this job
        raise JobError(
            f"job {ctx.job_id} reads {redact_url(row.input_uri)}, not {redact_url(c.input.uri)}; "
            "a job's input is fixed once planned: give the other input a job id of its own"
        )
    ctx.check_isolation()
    if row.config_fingerprint != config_fingerprint(c):
        log.warning(
            "job %s: config changed since it was planned; items whose request changed are generated again", ctx.job_id
        )
    return None


@contextmanager
def planning_step(ctx: JobContext, epoch: int):
    """A planning step of the planning claim `epoch` renews the planning's lease while it runs (planning a
    large job outlasts one), and one that fails marks the planning failed, so that a rerun takes it over at
    once. Both are fenced by the epoch: a step of a planning worker that was taken over changes nothing (a
    job another worker is planning, or finished planning, stays so)."""
    lease = ctx.config.state.lease_seconds

    def renew() -> bool:
        if ctx.state.renew_planning(ctx.job_id, epoch, ctx.worker, lease):
            return True
        row = ctx.state.job(ctx.job_id)
        if row is not None and row.status == "planning" and row.planning_epoch != epoch:
            log.warning(
                "job %s: planning claim %d was taken over by another worker (claim %d); what this step "
                "plans is not registered",
                ctx.job_id,
                epoch,
                row.planning_epoch,
            )
        return False

    with Renewal(renew, lease, f"planning-{ctx.job_id}"):
        try:
            yield
        except Exception as e:
            ctx.state.fail_planning(ctx.job_id, epoch, str(e))
            raise


def plan_input(ctx: JobContext, epoch: int) -> None:
    """Plan the job (plan/streamed.py: streamed by file, sharded by scope) into the staging area; register
    its partitions."""
    started = time.perf_counter()
    with planning_step(ctx, epoch):
        planned = plan_job(ctx.config, ctx.job_id, ctx.staging, cache=ctx.cache, report=ctx.progress.planning)
        register_plan(ctx, epoch, planned, time.perf_counter() - started)


def register_plan(ctx: JobContext, epoch: int, planned: Plan, seconds: float) -> None:
    """Register the planned partitions and mark the job planned, in one transaction fenced by the claim."""
    faults.checkpoint("before_register", ctx.job_id, "")
    counts = JobCounts(
        records=planned.records,
        staging={
            "records": planned.records,
            "partitions": len(planned.partitions),
            "skipped_files": planned.skipped,
            "dedup": planned.dedup.as_dict(),
            "shards": planned.shards,
            "cut_scopes": {s: len(r) for s, r in planned.cut.items()},
            "step_seconds": {k: round(v, 3) for k, v in planned.seconds.items()},
            "seconds": round(seconds, 3),
            "isolation": isolation_fingerprint(ctx.config),
            "batch_files": planned.batch_files,
        },
    )
    if not ctx.state.register_partitions(ctx.job_id, epoch, planned.partitions, counts.as_json()):
        row = ctx.state.job(ctx.job_id)
        if row is not None and row.status not in PLANNING:
            log.info("job %s: planned meanwhile by another worker; its partitions stand", ctx.job_id)
            return
        raise JobError(
            f"job {ctx.job_id}: its planning was taken over by another worker (claim {epoch} superseded); "
            "this planning registered nothing"
        )
    write_manifest(ctx.out, ctx.job_id, current_manifest(ctx, partial=True))


# -- planning as an orchestrator's tasks: keyed once, one task per shard, registered once -----------------
def keyed_shards(ctx: JobContext) -> list[int]:
    """Claim the job's planning and key its input (plan/streamed.py step 1): the shards to cluster, [] when planned."""

    def keyed(ctx: JobContext, epoch: int) -> list[int]:
        c = ctx.config
        listed = list_input(c)
        workers = planning_workers(c, sum(size for _, _, size in listed[0]))
        with planning_step(ctx, epoch), planning_pool(workers) as pool:
            plan = plan_keyed(c, ctx.job_id, ctx.staging, listed, workers, pool, report=ctx.progress.planning)
            return list(range(plan.shards))

    return ensure_planned(ctx, keyed) or []


def _planning_epoch(ctx: JobContext) -> int | None:
    """The planning claim's epoch while the job's planning has begun and is not done (a planning task of an
    orchestrator may run under it), else None."""
    row = ctx.state.job(ctx.job_id)
    return row.planning_epoch if row is not None and row.status in PLANNING else None


def clustered_shard(ctx: JobContext, shard: int) -> dict:
    """Cluster one shard (plan/streamed.py step 2); its dedup figures. Nothing to do once the job is planned."""
    epoch = _planning_epoch(ctx)
    if epoch is None:
        return {}
    with planning_step(ctx, epoch):
        return plan_shard(ctx.config, ctx.job_id, ctx.staging, shard, ctx.cache).as_dict()


def planned_from_shards(ctx: JobContext) -> None:
    """Write every partition's records from the clustered shards and register them (plan/streamed.py step 3),
    once.

    Only a plan whose every shard is clustered is registered here. Anything else (planned already, not
    begun, or another worker planning it whole right now) is left to `ensure_planned`, which waits for
    that worker or takes a dead one's planning over: this step never fails someone else's planning."""
    row = ctx.state.job(ctx.job_id)
    if row is None or row.status not in PLANNING:
        return
    planned = clustered_plan(ctx.staging)
    if planned is None:
        return
    epoch = row.planning_epoch
    if row.status == "planning_failed":  # a shard task failed, and its retry clustered the shard: take over
        epoch = ctx.state.reclaim_planning(ctx.job_id, ctx.config.state.lease_seconds, ctx.worker)
        if epoch is None:
            return  # another worker took it over first: ensure_planned waits for it
    started = time.perf_counter()
    with (
        planning_step(ctx, epoch),
        planning_pool(planning_workers(ctx.config, 0)) as pool,
    ):  # in this process unless set
        register_plan(
            ctx,
            epoch,
            plan_staged(ctx.config, ctx.job_id, ctx.staging, pool, planned, ctx.progress.planning),
            time.perf_counter() - started,
        )
