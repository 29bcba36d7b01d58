"""The nightly DAG on the production topology: the CeleryExecutor on Redis, a queue per tier.

tests/airflow_deploy.py starts the Airflow components of infra/single-host/docker-compose.yaml
(api-server, scheduler, dag-processor, triggerer) with its settings on a throwaway PostgreSQL metadata
database, with the CeleryExecutor on a throwaway Redis (the broker infra/ deploys). The test starts the
compose file's Celery workers with their commands and environments, each a process of its own: `cpu`
consumes `default` (planning, prepare, commit), `small-a` only `gpu-small` and `large` only `gpu-large`,
each GPU worker naming the tier it serves in TOKENMILL_WORKER_TIERS (a drain
of another tier reaching it would fail at once, naming both). Each worker's task processes report the
worker's name as their hostname, so every task instance says where it ran.

The worker `small-a` is lost mid-drain: its fake engine finishes 4 requests and then holds every other
one in flight (`fake.stall_after`, set in that worker's environment only; not part of any key), and
once it holds work units with busy time it never stored, the test SIGKILLs the worker with everything
it started. A replacement, `small-b`, is then started on `gpu-small`: it takes the small tier's other
drain task off the queue and, the dead holder being provably gone, the dead worker's units at once. The
scheduler fails the killed task instance when its heartbeats stop; the commits, which wait for every
drain (trigger rule all_done), then run. One partition also fails in `prepare` (the fault hook); ops
clear it with downstream and it alone runs again.
"""

from __future__ import annotations

import psutil
import pytest

from pipeline.dev.samples import write_sample_corpus
from tests.airflow_deploy import AirflowDeployment, write_faults
from tests.conftest import read_kind
from tests.jobs import assert_exactly_once, scalar
from tests.nightly_dag import (
    DAG_ID,
    check_engine_starts,
    check_ledger_is_held_time,
    deployment,
    drain_reports,
    job_id,
    ledger_by_partition,
    manifest,
    paid_items,
    partition_commits,
    tokenmill_env,
)

pytestmark = pytest.mark.airflow_deploy

RUN_DATE = "2026-11-30"
JOB_ID = job_id(RUN_DATE)
DOCUMENTS = 24
RECORDS_PER_PARTITION = 4  # about a dozen partitions: a night of many, each its own mapped tasks
TIER_WORKERS = {"small": 2, "large": 1}  # drain tasks per tier
GPUS = {"small": 2, "large": 1}  # pool slots per tier: the GPUs its workers hold
VICTIM = ("batch-a.jsonl", 0)  # fails in prepare, before anything of it is generated
HEARTBEAT_TIMEOUT = 20  # seconds without a heartbeat before the scheduler fails a task instance


@pytest.fixture
def celery_airflow(tmp_path, tiny_models, static_embedder, postgres_admin_url, redis_server):
    env = {
        **tokenmill_env(tmp_path, RECORDS_PER_PARTITION, TIER_WORKERS),
        "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": str(HEARTBEAT_TIMEOUT),
    }
    stall = {"TOKENMILL_TIERS__SMALL__FAKE__STALL_AFTER": "4", "TOKENMILL_TIERS__SMALL__FAKE__STEP_SECONDS": "0.01"}
    # the compose file's workers, each with its command (queues, concurrency) and its own environment
    workers = (
        ("cpu", "airflow-worker-cpu", {}),
        ("small-a", "airflow-worker-gpu-small", {"env": stall}),
        ("large", "airflow-worker-gpu-large", {}),
    )
    celery = {"executor": "CeleryExecutor", "broker_url": redis_server.url}
    with deployment(tmp_path, postgres_admin_url, env, GPUS, workers=workers, **celery) as af:
        yield af


def _where_ran(af: AirflowDeployment, run_id: str) -> dict[tuple[str, int], tuple[str, str, str]]:
    """(task_id, map_index) -> (hostname, queue, state) of its latest try."""
    return {
        (ti["task_id"], ti["map_index"]): (ti["hostname"], ti["queue"], ti["state"])
        for ti in af.task_instances(DAG_ID, run_id)
    }


def _held_by(af: AirflowDeployment, worker: str, state_db) -> bool:
    """The Celery worker `worker` holds small-tier units with busy time it never stored (the stall)."""
    pids = {p.pid for p in psutil.Process(af.workers[worker].pid).children(recursive=True)}
    if not state_db.exists() or not scalar(state_db, "select count(*) from sqlite_master where name='work_units'"):
        return False
    import sqlite3

    with sqlite3.connect(state_db, timeout=30) as c:
        holders = c.execute(
            "select distinct u.worker from work_units u join engine_sessions s on s.session_id = u.session_id "
            "where u.job_id=? and u.tier='small' and u.status='leased' and s.busy_seconds - s.recorded_seconds > 0.01",
            (JOB_ID,),
        ).fetchall()
    return any(int(h.rpartition(":")[2]) in pids for (h,) in holders if h and h.rpartition(":")[2].isdigit())


def test_celery_topology_routes_each_tier_to_its_workers_and_survives_a_killed_worker(
    celery_airflow: AirflowDeployment, tmp_path
):
    from pipeline.ingest.read import partition_id
    from pipeline.stores.catalog import StateStore

    af, output, state_db = celery_airflow, tmp_path / "output", tmp_path / "state.db"
    corpus = write_sample_corpus(tmp_path / "input", documents=DOCUMENTS)
    victim = partition_id(*VICTIM)
    faults = tmp_path / "faults.json"
    write_faults(faults, [{"job": JOB_ID, "partition": victim, "point": "before_generate", "error": "injected"}])
    conf = {"input_uri": str(tmp_path / "input"), "output_uri": str(output)}

    # 1. The run; `small-a` is killed with work in flight, `small-b` replaces it.
    run_id = af.trigger(DAG_ID, conf, logical_date=f"{RUN_DATE}T00:00:00Z")
    af.wait_until(lambda: _held_by(af, "small-a", state_db))
    af.kill_worker("small-a")
    af.start_worker("small-b", "airflow-worker-gpu-small")
    run = af.wait_for_run(DAG_ID, run_id, timeout=600)
    where, logs = _where_ran(af, run_id), af.failed_logs(DAG_ID, run_id)
    assert run["state"] == "failed", (where, logs)  # the victim did not commit

    # Every task ran on its queue's workers and no other.
    for (task, index), (host, queue, state) in where.items():
        if state not in ("success", "failed"):
            continue  # never ran (none should be left; the states are checked below)
        tier = task.removeprefix("drain_") if task.startswith("drain_") else None
        expected = {"small": {"small-a", "small-b"}, "large": {"large"}}.get(tier, {"cpu"})
        assert queue == (f"gpu-{tier}" if tier else "default") and host in expected, (task, index, host, queue)
    small = {index: (host, state) for (task, index), (host, _, state) in where.items() if task == "drain_small"}
    assert sorted(small.values()) == [("small-a", "failed"), ("small-b", "success")], small  # heartbeats stopped
    assert where[("drain_large", 0)][2] == "success"

    # The partitions: the victim failed in prepare, every other one committed, the killed work included.
    state = StateStore(f"sqlite:///{state_db}")
    partitions = {p.partition: p for p in state.partitions(JOB_ID)}
    others = sorted(set(partitions) - {victim})
    assert len(partitions) >= 8 and partitions[victim].status == "failed", partitions
    assert {p: partitions[p].status for p in others} == dict.fromkeys(others, "succeeded"), logs
    # The replacement took the dead worker's units over (their claims' epochs moved on), not a rerun.
    taken = scalar(
        state_db,
        "select count(*) from unit_claims c join work_units u using (job_id, unit_id) "
        f"where c.job_id='{JOB_ID}' and c.finished = 0 and c.epoch < u.epoch",
    )
    assert taken >= 1
    lost = [r for r in read_kind(output, "ledger", JOB_ID).to_pylist() if r["kind"] == "lost"]
    assert lost and all(r["tier"] == "small" and r["gpu_seconds"] > 0 for r in lost)  # its time is billed

    # Each engine started once per drain task that ran to its end with work; the killed one's start counts.
    reports = drain_reports(af, run_id, TIER_WORKERS)
    finished = check_engine_starts({t: [r for r in rs if r] for t, rs in reports.items()})
    engines = manifest(output, JOB_ID)["engines"]
    assert engines["small"]["starts"] == finished["small"] + 1 == 2, engines
    assert engines["large"]["starts"] == finished["large"] == 1, engines
    assert all(r["worker"].rpartition(":")[0] for rs in reports.values() for r in rs if r)  # each says who ran it

    # 2. The victim's prepare cleared with downstream: it alone runs again, on the workers left.
    faults.unlink()
    commits, ledger, paid = (
        partition_commits(output, JOB_ID),
        ledger_by_partition(output, JOB_ID),
        paid_items(state_db, JOB_ID),
    )
    index = af.map_index(DAG_ID, run_id, "prepare", victim)
    af.clear(DAG_ID, run_id, [["prepare", index]], include_downstream=True)
    run = af.wait_for_run(DAG_ID, run_id, timeout=300)
    where = _where_ran(af, run_id)
    assert run["state"] == "success", (where, af.failed_logs(DAG_ID, run_id))
    assert {host for (task, _), (host, _, _) in where.items() if task == "drain_small"} == {"small-b"}
    tries = {(ti["task_id"], ti["map_index"]): ti["try_number"] for ti in af.task_instances(DAG_ID, run_id)}
    assert all(n == 1 for (t, i), n in tries.items() if t == "prepare" and i != index), tries
    new_commits, new_ledger, new_paid = (
        partition_commits(output, JOB_ID),
        ledger_by_partition(output, JOB_ID),
        paid_items(state_db, JOB_ID),
    )
    assert {p: new_commits[p] for p in others} == {p: commits[p] for p in others}  # committed ones untouched
    assert {p: new_ledger.get(p) for p in others} == {p: ledger.get(p) for p in others}  # nothing charged again
    assert new_paid.get(victim) and {p: n for p, n in new_paid.items() if p != victim} == paid  # nor paid twice

    check_ledger_is_held_time(output, JOB_ID)
    assert_exactly_once(output, JOB_ID, corpus, state_db)
