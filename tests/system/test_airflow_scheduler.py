"""The nightly DAG under a real Airflow 3 deployment, not `dag.test()`.

tests/airflow_deploy.py starts the api-server, a scheduler with the LocalExecutor (real task processes,
which talk to the execution API) and the dag-processor, on a throwaway PostgreSQL metadata database.
The test triggers a run with `conf` over the REST API, watches its task instances, and re-runs the
failed partitions the way ops would: clearing their `prepare` task instances with downstream.

Two partitions fail, one at each end of the GPU work: one in `prepare` (before anything of it is
generated: its re-run needs the engines again) and one in `commit` (after its generations are paid:
its re-run must generate nothing). A task process cannot see an injector registered in this process,
so they fail through the deployment's fault hook (a file the task processes read at every fault point
of pipeline/job/faults.py); deleting the file removes the faults.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pipeline.dev.samples import write_sample_corpus
from tests.airflow_deploy import AirflowDeployment, airflow_database, fault_hook_env, write_faults
from tests.conftest import FAKE_ENGINE, REPO, TINY_CONFIG, read_kind
from tests.jobs import assert_exactly_once

pytestmark = pytest.mark.airflow_deploy

DAG_ID = "nightly_summarization"
RUN_DATE = "2026-11-29"
JOB_ID = f"{DAG_ID}-{RUN_DATE}"
DOCUMENTS = 24
RECORDS_PER_PARTITION = 10  # a partition per file of the corpus's seven (each costs two task processes)
TIER_WORKERS = {"small": 2, "large": 1}  # drain tasks per tier; each tier's pool has one slot (one GPU)
# The failing partitions (input file, chunk) and where: in prepare, before its lookups and requests;
# in commit, with outputs assembled and nothing written.
# What every task process imports (the DAG's module, the fake engine's tokenizer class): the scheduler
# imports them once and its task processes inherit them, instead of paying seconds each.
PRELOAD = ("pipeline.job.orchestrate", "pipeline.generate.fake_engine", "transformers.tokenization_utils_tokenizers")
VICTIMS = {"before_generate": ("batch-a.jsonl", 0), "before_commit": ("batch-b.jsonl.gz", 0)}


@pytest.fixture
def airflow(tmp_path, tiny_models, static_embedder, postgres_admin_url):
    """The deployment with this test's tokenmill settings in every task process's environment, the
    GPU pools created and the DAG parsed and unpaused. (No engine lock: its tier workers run the fake engine.)"""
    env = {
        "TOKENMILL_HOME": os.environ["TOKENMILL_HOME"],  # the tiny models (conftest)
        "TOKENMILL_CONFIG": str(TINY_CONFIG),  # the DAG's shape at parse time: tier names, run section
        "TOKENMILL_STATE__URL": f"sqlite:///{tmp_path}/state.db",
        "TOKENMILL_CACHE__PATH": str(tmp_path / "cache"),
        "TOKENMILL_INPUT__RECORDS_PER_PARTITION": str(RECORDS_PER_PARTITION),
        "TOKENMILL_RUN__TIER_WORKERS": json.dumps(TIER_WORKERS),
        "TOKENMILL_RUN__RETRIES": "0",  # a failure fails its task at once
        "TOKENMILL_RUN__PROGRESS": "log",
        **FAKE_ENGINE,  # Airflow is what is tested here; the tier workers drain the fake engine
        **fault_hook_env(tmp_path / "hook", tmp_path / "faults.json"),
    }
    with airflow_database(postgres_admin_url) as db:
        af = AirflowDeployment(
            tmp_path / "airflow", REPO / "dags", db, env=env, drop_env=("AIRFLOW", "TOKENMILL_"), preload=PRELOAD
        )
        af.start()
        try:
            for tier in TIER_WORKERS:
                af.create_pool(f"gpu-{tier}", 1, f"{tier} tier GPU workers")
            af.wait_for_dag(DAG_ID)
            af.unpause(DAG_ID)
            yield af
        finally:
            af.stop()


def _manifest(output: Path) -> dict:
    return json.loads((output / "jobs" / JOB_ID / "manifest.json").read_text())


def _commit_records(output: Path) -> dict[str, bytes]:
    folder = output / "_commits" / f"job={JOB_ID}"
    return {f.stem.removeprefix("partition="): f.read_bytes() for f in folder.glob("partition=*.json")}


def _ledger_by_partition(output: Path) -> dict[str, list[tuple]]:
    """partition -> its ledger rows (kind, id, gpu_seconds), sorted."""
    out: dict[str, list[tuple]] = {}
    for row in read_kind(output, "ledger", JOB_ID).select(["partition", "kind", "id", "gpu_seconds"]).to_pylist():
        out.setdefault(row["partition"], []).append((row["kind"], row["id"] or "", row["gpu_seconds"]))
    return {p: sorted(rows) for p, rows in out.items()}


def _paid_items(state_db: Path) -> dict[str, int]:
    """partition -> paid-for items (generations) the catalog holds for it."""
    import sqlite3

    with sqlite3.connect(state_db, timeout=30) as c:
        return dict(c.execute("select partition, count(*) from items where job_id=? group by partition", (JOB_ID,)))


def _drain_reports(af: AirflowDeployment, run_id: str) -> dict[str, list[dict]]:
    """tier -> what each of its drain tasks returned (units, engine_started, ...)."""
    return {
        tier: [af.xcom(DAG_ID, run_id, f"drain_{tier}", i) or {} for i in range(n)] for tier, n in TIER_WORKERS.items()
    }


def _check_engine_starts(drains: dict[str, list[dict]]) -> dict[str, int]:
    """A drain worker starts its tier's engine once if it had work, and not at all if not (the second
    small one: its pool's one slot frees only when the first has drained the tier). Returns starts per tier."""
    for tier, reports in drains.items():
        assert all(r.get("engine_started") == (r.get("units", 0) > 0) for r in reports), (tier, reports)
    return {tier: sum(1 for r in reports if r.get("units", 0) > 0) for tier, reports in drains.items()}


def test_dag_under_scheduler_fails_two_partitions_then_reruns_them_alone(airflow: AirflowDeployment, tmp_path):
    from pipeline.config import load_config
    from pipeline.ingest.read import partition_id
    from pipeline.stores.catalog import StateStore

    af, output, state_db = airflow, tmp_path / "output", tmp_path / "state.db"
    corpus = write_sample_corpus(tmp_path / "input", documents=DOCUMENTS)
    victims = {point: partition_id(file, chunk) for point, (file, chunk) in VICTIMS.items()}  # good records only
    early, late = victims["before_generate"], victims["before_commit"]
    faults = tmp_path / "faults.json"
    write_faults(
        faults,
        [
            {"job": JOB_ID, "partition": p, "point": point, "error": f"injected: {point} lost"}
            for point, p in victims.items()
        ],
    )
    conf = {"config": str(TINY_CONFIG), "input_uri": str(tmp_path / "input"), "output_uri": str(output)}

    tasks = af.tasks(DAG_ID)
    assert {f"drain_{t}" for t in TIER_WORKERS} <= set(tasks)
    for tier in TIER_WORKERS:  # pool and queue per tier, parsed from the config's tier names
        assert tasks[f"drain_{tier}"]["pool"] == f"gpu-{tier}" and tasks[f"drain_{tier}"]["queue"] == f"gpu-{tier}"

    # 1. The run: the victims fail, every other partition commits, the run fails.
    run_id = af.trigger(DAG_ID, conf, logical_date=f"{RUN_DATE}T00:00:00Z")
    run = af.wait_for_run(DAG_ID, run_id, timeout=360)
    states = af.task_states(DAG_ID, run_id)
    failed_logs = af.failed_logs(DAG_ID, run_id)
    assert run["state"] == "failed", states
    state = StateStore(f"sqlite:///{state_db}")
    partitions = {p.partition: p for p in state.partitions(JOB_ID)}
    assert len(partitions) >= 7 and set(victims.values()) <= set(partitions)
    others = sorted(set(partitions) - set(victims.values()))
    for point, p in victims.items():
        assert partitions[p].status == "failed", (point, failed_logs)
    # Why each failed, as the catalog tells ops (checked last, so that the re-run is checked either way).
    causes = {point: partitions[p].last_error or "" for point, p in victims.items()}
    assert {p: partitions[p].status for p in others} == dict.fromkeys(others, "succeeded"), failed_logs
    assert states[("prepare", early)] == "failed" and states[("commit", early)] == "failed", (states, failed_logs)
    assert states[("prepare", late)] == "success" and states[("commit", late)] == "failed", (states, failed_logs)
    assert all(states[("prepare", p)] == "success" and states[("commit", p)] == "success" for p in others), (
        states,
        failed_logs,
    )
    assert all(v == "success" for (t, _), v in states.items() if t.startswith("drain_")), (states, failed_logs)
    assert states[("summary", None)] == "success" and states[("outcome", None)] == "failed", (states, failed_logs)
    paid = _paid_items(state_db)
    assert early not in paid and paid.get(late)  # the late victim's generations are paid for already

    # Each tier's engine started once per drain worker that had work, not once per partition.
    first = _check_engine_starts(_drain_reports(af, run_id))
    engines = _manifest(output)["engines"]
    assert {t: engines.get(t, {}).get("starts", 0) for t in TIER_WORKERS} == first, engines
    assert first["small"] >= 1 and first["large"] >= 1, first  # both tiers had work (routing rules, escalation)

    # 2. The workers are back: clear both victims' prepare with downstream; only they run again.
    faults.unlink()
    before = {p: (v.status, v.attempts) for p, v in partitions.items()}
    commits, ledger = _commit_records(output), _ledger_by_partition(output)
    assert set(commits) == set(others) and set(ledger) <= set(others)  # (all-bad partitions: no ledger rows)
    indexes = {p: af.map_index(DAG_ID, run_id, "prepare", p) for p in victims.values()}
    cleared = af.clear(DAG_ID, run_id, [["prepare", i] for i in indexes.values()], include_downstream=True)
    cleared_ids = {(c["task_id"], c["map_index"]) for c in cleared}
    assert {("prepare", i) for i in indexes.values()} | {("outcome", -1)} <= cleared_ids
    assert not any(t == "prepare" and i not in indexes.values() for t, i in cleared_ids)  # others' prepare kept
    run = af.wait_for_run(DAG_ID, run_id, timeout=300)
    states = af.task_states(DAG_ID, run_id)
    assert run["state"] == "success", (states, af.failed_logs(DAG_ID, run_id))
    tries = {(ti["task_id"], ti["map_index"]): ti["try_number"] for ti in af.task_instances(DAG_ID, run_id)}
    assert all(n == 1 for (t, i), n in tries.items() if t == "prepare" and i not in indexes.values()), tries

    after = {p.partition: (p.status, p.attempts) for p in state.partitions(JOB_ID)}
    assert after[early][0] == "succeeded" and after[late][0] == "succeeded"
    assert {p: after[p] for p in others} == {p: before[p] for p in others}  # committed partitions: not re-run
    new_commits, new_ledger, new_paid = _commit_records(output), _ledger_by_partition(output), _paid_items(state_db)
    assert {p: new_commits[p] for p in others} == commits  # their commits unchanged
    assert {p: new_ledger.get(p) for p in others} == {p: ledger.get(p) for p in others}  # nothing charged again
    assert early in new_ledger and late in new_ledger
    assert new_paid.get(early) and {p: n for p, n in new_paid.items() if p != early} == paid  # nothing paid twice

    # Engines: the re-run started them again only for the early victim's work.
    second = _check_engine_starts(_drain_reports(af, run_id))
    engines = _manifest(output)["engines"]
    assert {t: engines.get(t, {}).get("starts", 0) for t in TIER_WORKERS} == {
        t: first[t] + second[t] for t in TIER_WORKERS
    }, (first, second, engines)
    assert second["small"] + second["large"] >= 1, second

    # The ledger carries exactly the engines' held time × GPUs (start-up and idle included).
    config = load_config(TINY_CONFIG)
    held = sum(e["held_seconds"] * config.tiers[tier].gpus for tier, e in engines.items())
    charged = sum(read_kind(output, "ledger", JOB_ID)["gpu_seconds"].to_pylist())
    assert held > 0 and charged == pytest.approx(held, rel=1e-6), engines

    # Every record accounted once: no id twice among the outputs, then the suite's full check.
    ids = read_kind(output, "outputs", JOB_ID)["id"].to_pylist()
    assert len(ids) == len(set(ids))
    assert_exactly_once(output, JOB_ID, corpus, state_db)

    # The catalog kept each failure's cause, even where the partition's commit task ran after it.
    assert all(f"injected: {point} lost" in cause for point, cause in causes.items()), causes
