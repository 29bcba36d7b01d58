"""Staging, the job phase that runs the CPU stages over the whole input once, and the staging area
it writes to.

The staging area: each partition's records and quarantine rows as staging wrote them, and the
engine requests `prepare` made ready for it, under `<output>/_staging/job=<job>/partition=<p>/`.

tokenmill's own files: written atomically, read by partition runs, never read by analysts.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING

import pyarrow as pa

from pipeline.ingest.read import input_files
from pipeline.job.errors import JobError
from pipeline.job.plan import (
    Plan,
    clustered_plan,
    plan_job,
    plan_keyed,
    plan_shard,
    plan_staged,
    planning_pool,
    planning_workers,
)
from pipeline.output.write import write_manifest
from pipeline.stores import storage

if TYPE_CHECKING:
    from pipeline.job.lifecycle import Job

log = logging.getLogger(__name__)

PREPARED = ("units", "requests", "too_long")  # what `prepare` stashes for a partition


class StagingArea:
    def __init__(self, root: storage.Location, job_id: str):
        self.root, self.job_id = root, job_id

    def path(self, partition: str, name: str) -> str:
        return self.root.join("_staging", f"job={self.job_id}", f"partition={partition}", name)

    def write(self, partition: str, name: str, table: pa.Table) -> None:
        storage.write_parquet_atomic(self.root, self.path(partition, f"{name}.parquet"), table, "zstd")

    def write_json(self, name: str, data: dict) -> None:
        """A job-level file of planning's (`plan.json`, `shard-<n>.json`), beside the partitions."""
        storage.write_bytes_atomic(self.root, self.root.join("_staging", f"job={self.job_id}", f"{name}.json"),
                                   json.dumps(data).encode())

    def read_json(self, name: str) -> dict:
        return json.loads(storage.read_bytes(self.root, self.root.join("_staging", f"job={self.job_id}", f"{name}.json")))

    def read(self, partition: str, name: str, columns: list[str] | None = None) -> pa.Table:
        return storage.read_parquet(self.root, self.path(partition, f"{name}.parquet"), columns)

    # Prepared requests are keyed by the config fingerprint: requests made under another prompt or
    # model are never reused.
    def write_prepared(self, partition: str, fingerprint: str, tables: dict[str, pa.Table]) -> None:
        for name in PREPARED:
            self.write(partition, f"prepared-{fingerprint}-{name}", tables[name])

    def read_prepared(self, partition: str, fingerprint: str) -> dict[str, pa.Table] | None:
        """The prepared tables, or None when `prepare` has not run for this partition and config."""
        try:
            return {name: self.read(partition, f"prepared-{fingerprint}-{name}") for name in PREPARED}
        except storage.StorageError:
            return None


def ensure_staged(job: Job, stage=None):
    """Stage the job unless it is staged already (or wait while another worker stages it).

    `stage(job)` does the staging (default: all of planning, `stage_input`); its result is returned,
    or None when the job was staged already."""
    stage = stage or stage_input
    c = job.config
    if job.state.claim_staging(job.job_id, c.fingerprint(), c.input.uri, c.output.uri):
        return stage(job)
    while True:
        row = job.state.job(job.job_id)
        if row.status not in ("staging", "staging_failed"):
            break
        if job.state.reclaim_staging(job.job_id, c.state.lease_seconds):
            return stage(job)  # the last staging failed or its worker died
        time.sleep(c.state.wait_seconds)  # another worker is staging it now
    if row.output_uri != c.output.uri:
        raise JobError(f"job {job.job_id} writes to {row.output_uri}, not {c.output.uri}; use that output")
    if row.config_fingerprint != c.fingerprint():
        log.warning("job %s: config changed since it was staged; items whose request changed are generated again",
                    job.job_id)
    return None


@contextmanager
def staging_step(job: Job):
    """A staging step renews the staging's lease while it runs (planning a large job outlasts one), and
    one that fails marks the staging failed, so that a rerun takes it over at once (a staging still in
    progress only: a job another worker finished staging stays staged)."""
    done = threading.Event()

    def renew():
        while not done.wait(job.config.state.lease_seconds / 3):
            try:
                job.state.renew_staging(job.job_id)
            except Exception as e:  # a catalog blip: the next beat tries again; the lease has room for it
                log.warning("job %s: could not renew the staging lease: %s", job.job_id, e)

    beat = threading.Thread(target=renew, name="staging-lease", daemon=True)
    beat.start()
    try:
        yield
    except Exception as e:
        job.state.set_job(job.job_id, only_from="staging", status="staging_failed", error=str(e)[:2000])
        raise
    finally:
        done.set()
        beat.join()


def stage_input(job: Job) -> None:
    """Plan the job (plan.py: streamed by file, sharded by scope) into the staging area; register partitions."""
    started = time.perf_counter()
    with staging_step(job):
        register_plan(job, plan_job(job.config, job.job_id, job.staging, cache=job.cache), time.perf_counter() - started)


def register_plan(job: Job, plan: Plan, seconds: float) -> None:
    """Register the planned partitions and mark the job staged."""
    job.state.add_partitions(job.job_id, plan.partitions)
    job.state.set_job(job.job_id, status="staged", counts={"records": plan.records, "staging": {
        "records": plan.records, "partitions": len(plan.partitions), "skipped_files": plan.skipped,
        "dedup": plan.dedup.as_dict(), "shards": plan.shards, "cut_scopes": {s: len(r) for s, r in plan.cut.items()},
        "step_seconds": {k: round(v, 3) for k, v in plan.seconds.items()}, "seconds": round(seconds, 3)}})
    write_manifest(job.out, job.job_id, job.manifest(partial=True))


# -- planning as an orchestrator's tasks: keyed once, one task per shard, staged once -----------------
def keyed_shards(job: Job) -> list[int]:
    """Claim the job's staging and key its input (plan.py step 1): the shards to cluster, [] when staged."""
    def keyed(job: Job) -> list[int]:
        c = job.config
        files, _ = input_files(storage.resolve(c.input.uri, c.storage))
        workers = planning_workers(c, sum(size for _, _, size in files))
        with staging_step(job), planning_pool(workers) as pool:
            return list(range(plan_keyed(c, job.job_id, job.staging, workers, pool).shards))
    return ensure_staged(job, keyed) or []


def _planning(job: Job) -> bool:
    """The job's staging has begun and is not done (a planning step of an orchestrator may run)."""
    row = job.state.job(job.job_id)
    return row is not None and row.status in ("staging", "staging_failed")


def clustered_shard(job: Job, shard: int) -> dict:
    """Cluster one shard (plan.py step 2); its dedup figures. Nothing to do once the job is staged."""
    if not _planning(job):
        return {}
    with staging_step(job):
        return plan_shard(job.config, job.job_id, job.staging, shard, job.cache).as_dict()


def staged_from_shards(job: Job) -> None:
    """Stage every partition from the clustered shards and register them (plan.py step 3), once.

    Only a plan whose every shard is clustered is staged here. Anything else (staged already, not begun,
    or another worker planning it whole right now) is left to `ensure_staged`, which waits for that
    worker or takes a dead one's staging over: a stage step never fails someone else's planning."""
    plan = clustered_plan(job.staging) if _planning(job) else None
    if plan is None:
        return
    started = time.perf_counter()
    with staging_step(job), planning_pool(planning_workers(job.config, 0)) as pool:  # in this process unless set
        register_plan(job, plan_staged(job.config, job.job_id, job.staging, pool, plan), time.perf_counter() - started)
