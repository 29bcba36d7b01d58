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
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

from pipeline.config import TokenmillConfig, redact_url
from pipeline.errors import JobError
from pipeline.job import faults
from pipeline.job.manifest import ManifestSources, current_manifest
from pipeline.job.preflight import check_engines, check_isolation
from pipeline.keys import config_fingerprint, isolation_fingerprint
from pipeline.output.manifest import JobCounts
from pipeline.output.tables import old_layout
from pipeline.output.write import write_manifest
from pipeline.plan.streamed import (
    Plan,
    Report,
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
from pipeline.stores.cache import ResilientStore
from pipeline.stores.catalog import StateStore, utc
from pipeline.stores.lease import Renewal, worker_is_gone
from pipeline.stores.staging import StagingArea

log = logging.getLogger(__name__)
# A gone planning worker (its host:pid process no longer exists) is replaced once it has not renewed for a third of
# the lease, at most this long: an orchestrator's planning tasks each renew as their own process.
GONE_GRACE_SECONDS = 15.0


@dataclass(frozen=True)
class Planning:
    """What the plan step uses, and only that (built by the job's context, `JobContext.planning`)."""

    config: TokenmillConfig
    job_id: str
    state: StateStore  # the planning lease, the job's row, its partitions registered
    worker: str  # whose planning claim
    out: storage.Location  # the output root, checked before any planning
    staging: StagingArea  # where planning writes what the later steps read
    manifests: ManifestSources  # the manifest of the job as planned
    report: Report  # planning's progress
    open_cache: Callable[[], ResilientStore]  # the cache whose index planning searches, opened when it plans


def plan(planning: Planning) -> None:
    """The plan step: check that the output root can be written and every tier's engine on this host (each
    drain checks its own again, where GPU tasks run elsewhere), then plan the job unless it is planned
    already."""
    # first: a refused config leaves no output folder behind
    check_engines(planning.config, list(planning.config.tiers))
    ensure_planned(planning)


def check_output_root(planning: Planning) -> None:
    """The output root can be written and is not of the layout before the Delta tables: refused before any
    planning, on every path that plans (`tokenmill run`, the DAG's first task)."""
    try:
        storage.check_writable(planning.out)
    except storage.StorageError as e:
        raise JobError(f"output root {e}: nothing was run; make it writable or set output.uri") from None
    if old_layout(planning.out):
        raise JobError(
            f"output root {planning.out.uri(planning.out.path)} holds commit records of the layout before Delta "
            "tables: nothing was run; "
            f"convert it once with `tokenmill tables migrate --output {planning.config.output.uri}`"
        )


def ensure_planned(planning: Planning, steps=None):
    """Plan the job unless it is planned already (or wait while another worker plans it, saying who and
    until when; a planning worker provably gone is taken over at once).

    `steps(planning, epoch)` does the planning under the planning claim `epoch` (default: all of planning,
    `plan_input`); its result is returned, or None when the job was planned already."""
    check_output_root(planning)
    steps = steps or plan_input
    c = planning.config
    epoch = planning.state.claim_planning(
        planning.job_id, config_fingerprint(c), c.input.uri, c.output.uri, planning.worker, c.state.lease_seconds
    )
    if epoch:
        return steps(planning, epoch)
    announced = None
    while True:
        row = planning.state.job(planning.job_id)
        if row.status not in PLANNING:
            break
        gone = (
            row.planning_worker
            if row.status == "planning" and row.planning_worker and worker_is_gone(row.planning_worker)
            else None
        )
        epoch = planning.state.reclaim_planning(
            planning.job_id,
            c.state.lease_seconds,
            planning.worker,
            gone_worker=gone,
            grace_seconds=min(c.state.lease_seconds / 3, GONE_GRACE_SECONDS),
        )
        if epoch:  # the last planning failed, its worker's lease ran out, or its worker is gone
            if gone:
                log.warning(
                    "job %s: its planning worker %s is gone (no such process on this host); planning it again now "
                    "instead of when its lease ends",
                    planning.job_id,
                    gone,
                )
            return steps(planning, epoch)
        if announced != (row.planning_worker, row.planning_epoch):
            announced = (row.planning_worker, row.planning_epoch)
            renewed, ends = row.planning_renewed_at, row.planning_lease_expires_at
            log.info(
                "job %s waits: planned by worker %s (last renewal %s) until its lease ends at %s (database "
                "clock), unless it finishes first",
                planning.job_id,
                row.planning_worker,
                utc(renewed),
                utc(ends),
            )
        time.sleep(c.state.wait_seconds)
    if row.output_uri != c.output.uri:
        raise JobError(f"job {planning.job_id} writes to {row.output_uri}, not {c.output.uri}; use that output")
    if row.input_uri != c.input.uri:  # a job id reused for other input (a DAG run's `job_id` param): not this job
        raise JobError(
            f"job {planning.job_id} reads {redact_url(row.input_uri)}, not {redact_url(c.input.uri)}; "
            "a job's input is fixed once planned: give the other input a job id of its own"
        )
    check_isolation(planning.state, planning.job_id, planning.config)
    if row.config_fingerprint != config_fingerprint(c):
        log.warning(
            "job %s: config changed since it was planned; items whose request changed are generated again",
            planning.job_id,
        )
    return None


@contextmanager
def planning_step(planning: Planning, epoch: int):
    """A planning step of the planning claim `epoch` renews the planning's lease while it runs (planning a
    large job outlasts one), and one that fails marks the planning failed, so that a rerun takes it over at
    once. Both are fenced by the epoch: a step of a planning worker that was taken over changes nothing (a
    job another worker is planning, or finished planning, stays so)."""
    lease = planning.config.state.lease_seconds

    def renew() -> bool:
        if planning.state.renew_planning(planning.job_id, epoch, planning.worker, lease):
            return True
        row = planning.state.job(planning.job_id)
        if row is not None and row.status == "planning" and row.planning_epoch != epoch:
            log.warning(
                "job %s: planning claim %d was taken over by another worker (claim %d); what this step "
                "plans is not registered",
                planning.job_id,
                epoch,
                row.planning_epoch,
            )
        return False

    with Renewal(renew, lease, f"planning-{planning.job_id}"):
        try:
            yield
        except Exception as e:
            planning.state.fail_planning(planning.job_id, epoch, str(e))
            raise


def plan_input(planning: Planning, epoch: int) -> None:
    """Plan the job (plan/streamed.py: streamed by file, sharded by scope) into the staging area; register
    its partitions."""
    started = time.perf_counter()
    with planning_step(planning, epoch):
        planned = plan_job(
            planning.config, planning.job_id, planning.staging, cache=planning.open_cache(), report=planning.report
        )
        register_plan(planning, epoch, planned, time.perf_counter() - started)


def register_plan(planning: Planning, epoch: int, planned: Plan, seconds: float) -> None:
    """Register the planned partitions and mark the job planned, in one transaction fenced by the claim."""
    faults.checkpoint("before_register", planning.job_id, "")
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
        },
    )
    if not planning.state.register_partitions(
        planning.job_id,
        epoch,
        planned.partitions,
        counts.as_json(),
        isolation=isolation_fingerprint(planning.config),
        batch_files=planned.batch_files,
    ):
        row = planning.state.job(planning.job_id)
        if row is not None and row.status not in PLANNING:
            log.info("job %s: planned meanwhile by another worker; its partitions stand", planning.job_id)
            return
        raise JobError(
            f"job {planning.job_id}: its planning was taken over by another worker (claim {epoch} superseded); "
            "this planning registered nothing"
        )
    write_manifest(planning.out, planning.job_id, current_manifest(planning.manifests, partial=True))


# -- planning as an orchestrator's tasks: keyed once, one task per shard, registered once -----------------
def keyed_shards(planning: Planning) -> list[int]:
    """Claim the job's planning and key its input (plan/streamed.py step 1): the shards to cluster, [] when planned.
    Every tier's engine is checked on this host first, as `plan` does."""

    def keyed(planning: Planning, epoch: int) -> list[int]:
        c = planning.config
        listed = list_input(c)
        workers = planning_workers(c, sum(size for _, _, size in listed[0]))
        with planning_step(planning, epoch), planning_pool(workers) as pool:
            plan = plan_keyed(c, planning.job_id, planning.staging, listed, workers, pool, report=planning.report)
            return list(range(plan.shards))

    check_engines(planning.config, list(planning.config.tiers))
    return ensure_planned(planning, keyed) or []


def _planning_epoch(planning: Planning) -> int | None:
    """The planning claim's epoch while the job's planning has begun and is not done (a planning task of an
    orchestrator may run under it), else None."""
    row = planning.state.job(planning.job_id)
    return row.planning_epoch if row is not None and row.status in PLANNING else None


def clustered_shard(planning: Planning, shard: int) -> dict:
    """Cluster one shard (plan/streamed.py step 2); its dedup figures. Nothing to do once the job is planned."""
    epoch = _planning_epoch(planning)
    if epoch is None:
        return {}
    with planning_step(planning, epoch):
        return plan_shard(planning.config, planning.job_id, planning.staging, shard, planning.open_cache()).as_dict()


def planned_from_shards(planning: Planning) -> None:
    """Write every partition's records from the clustered shards and register them (plan/streamed.py step 3),
    once.

    Only a plan whose every shard is clustered is registered here. Anything else (planned already, not
    begun, or another worker planning it whole right now) is left to `ensure_planned`, which waits for
    that worker or takes a dead one's planning over: this step never fails someone else's planning."""
    row = planning.state.job(planning.job_id)
    if row is None or row.status not in PLANNING:
        return
    planned = clustered_plan(planning.staging)
    if planned is None:
        return
    epoch = row.planning_epoch
    if row.status == "planning_failed":  # a shard task failed, and its retry clustered the shard: take over
        epoch = planning.state.reclaim_planning(planning.job_id, planning.config.state.lease_seconds, planning.worker)
        if epoch is None:
            return  # another worker took it over first: ensure_planned waits for it
    started = time.perf_counter()
    with (
        planning_step(planning, epoch),
        planning_pool(planning_workers(planning.config, 0)) as pool,
    ):  # in this process unless set
        register_plan(
            planning,
            epoch,
            plan_staged(planning.config, planning.job_id, planning.staging, pool, planned, planning.report),
            time.perf_counter() - started,
        )
