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

import pytest

from pipeline.dev.samples import write_sample_corpus
from tests.airflow_deploy import AirflowDeployment, write_faults
from tests.conftest import TINY_CONFIG, read_kind
from tests.jobs import assert_exactly_once
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

ROLLUP = "ledger_rollup"  # the downstream DAG scheduled on the ledger asset
RUN_DATE = "2026-11-29"
JOB_ID = job_id(RUN_DATE)
DOCUMENTS = 24
RECORDS_PER_PARTITION = 10  # a partition per file of the corpus, its two one-document notes packed in one: six
TIER_WORKERS = {"small": 2, "large": 1}  # drain tasks per tier; each tier's pool has one slot (one GPU)
# The failing partitions (input file, chunk) and where: in prepare, before its lookups and requests;
# in commit, with outputs assembled and nothing written.
VICTIMS = {"before_generate": ("batch-a.jsonl", 0), "before_commit": ("batch-b.jsonl.gz", 0)}


@pytest.fixture
def airflow(tmp_path, tiny_models, static_embedder, postgres_admin_url):
    """The deployment with this test's tokenmill settings in every task process's environment, the
    GPU pools created and the DAG parsed and unpaused. (No engine lock: its tier workers run the fake engine.)"""
    env = {
        **tokenmill_env(tmp_path, RECORDS_PER_PARTITION, TIER_WORKERS),
        # Runs from the scheduler too, for the asset-triggered ledger_rollup; none from a clock: the nightly
        # DAG gets no schedule (triggered runs only), so unpausing it starts nothing beside the test's run.
        "AIRFLOW__SCHEDULER__USE_JOB_SCHEDULE": "True",
        "TOKENMILL_RUN__SCHEDULE": "null",
        # OpenLineage through the provider's file transport: every task's events, one JSON line each.
        "AIRFLOW__OPENLINEAGE__TRANSPORT": json.dumps(
            {"type": "file", "log_file_path": str(tmp_path / "openlineage.jsonl"), "append": True}
        ),
        "AIRFLOW__OPENLINEAGE__NAMESPACE": "tokenmill-test",
    }
    with deployment(tmp_path, postgres_admin_url, env, dict.fromkeys(TIER_WORKERS, 1), (DAG_ID, ROLLUP)) as af:
        yield af


def test_dag_under_scheduler_fails_two_partitions_then_reruns_them_alone(airflow: AirflowDeployment, tmp_path):
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
    assert len(partitions) == 6 and set(victims.values()) <= set(partitions)
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
    paid = paid_items(state_db, JOB_ID)
    assert early not in paid and paid.get(late)  # the late victim's generations are paid for already

    # Each tier's engine started once per drain worker that had work, not once per partition.
    first = check_engine_starts(drain_reports(af, run_id, TIER_WORKERS))
    engines = manifest(output, JOB_ID)["engines"]
    assert {t: engines.get(t, {}).get("starts", 0) for t in TIER_WORKERS} == first, engines
    assert first["small"] >= 1 and first["large"] >= 1, first  # both tiers had work (routing rules, escalation)

    # 2. The workers are back: clear both victims' prepare with downstream; only they run again.
    faults.unlink()
    before = {p: (v.status, v.attempts) for p, v in partitions.items()}
    commits, ledger = partition_commits(output, JOB_ID), ledger_by_partition(output, JOB_ID)
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
    new_commits, new_ledger, new_paid = (
        partition_commits(output, JOB_ID),
        ledger_by_partition(output, JOB_ID),
        paid_items(state_db, JOB_ID),
    )
    assert {p: new_commits[p] for p in others} == commits  # their commits unchanged
    assert {p: new_ledger.get(p) for p in others} == {p: ledger.get(p) for p in others}  # nothing charged again
    assert early in new_ledger and late in new_ledger
    assert new_paid.get(early) and {p: n for p, n in new_paid.items() if p != early} == paid  # nothing paid twice

    # Engines: the re-run started them again only for the early victim's work.
    second = check_engine_starts(drain_reports(af, run_id, TIER_WORKERS))
    engines = manifest(output, JOB_ID)["engines"]
    assert {t: engines.get(t, {}).get("starts", 0) for t in TIER_WORKERS} == {
        t: first[t] + second[t] for t in TIER_WORKERS
    }, (first, second, engines)
    assert second["small"] + second["large"] >= 1, second

    check_ledger_is_held_time(output, JOB_ID)

    # Every record accounted once: no id twice among the outputs, then the suite's full check.
    ids = read_kind(output, "outputs", JOB_ID)["id"].to_pylist()
    assert len(ids) == len(set(ids))
    assert_exactly_once(output, JOB_ID, corpus, state_db)

    # The downstream DAG scheduled on the ledger asset ran after the commits, on the committed ledger;
    # the OpenLineage event of the last `summary` says input prefix -> the three tables, rows and cost.
    check_rollup_after_commits(af, run_id, output)
    check_lineage(tmp_path / "openlineage.jsonl", tmp_path / "input", output)

    # The catalog kept each failure's cause, even where the partition's commit task ran after it.
    assert all(f"injected: {point} lost" in cause for point, cause in causes.items()), causes


def check_rollup_after_commits(af: AirflowDeployment, run_id: str, output) -> None:
    """Each `summary` (the run's, the re-run's) updated the ledger asset; each update ran `ledger_rollup`
    after the nightly DAG's commit tasks, and the last one read the ledger as committed."""
    from datetime import datetime

    def finished() -> bool:  # both updates have happened by now: each rollup run to its end
        runs = af.dag_runs(ROLLUP)
        return len(runs) >= 2 and all(r["state"] in ("success", "failed") for r in runs)

    af.wait_until(finished, limit=180, poll=1.0)
    runs = af.dag_runs(ROLLUP)
    assert [r["state"] for r in runs] == ["success"] * len(runs), af.failed_logs(ROLLUP, runs[-1]["dag_run_id"])
    commits_end = max(
        datetime.fromisoformat(ti["end_date"]) for ti in af.task_instances(DAG_ID, run_id) if ti["task_id"] == "commit"
    )
    assert datetime.fromisoformat(runs[-1]["start_date"]) > commits_end
    result = af.xcom(ROLLUP, runs[-1]["dag_run_id"], "rollup")[-1]
    assert result["job_id"] == JOB_ID and result["output_uri"] == str(output)
    ledger = read_kind(output, "ledger", JOB_ID)
    assert sum(r["items"] for r in result["by_tenant_tier"]) == ledger.num_rows
    assert sum(r["cost_usd"] for r in result["by_tenant_tier"]) == pytest.approx(sum(ledger["cost_usd"].to_pylist()))


def check_lineage(events_file, input_dir, output) -> None:
    events = [json.loads(line) for line in events_file.read_text().splitlines() if line.strip()]
    done = [
        e for e in events if e["eventType"] == "COMPLETE" and e["job"]["name"] == f"{DAG_ID}.summary" and e["outputs"]
    ]
    assert done, sorted({(e["eventType"], e["job"]["name"]) for e in events})
    event = done[-1]  # the re-run's summary, over every partition
    assert event["job"]["namespace"] == "tokenmill-test"
    assert [(d["namespace"], d["name"]) for d in event["inputs"]] == [("file", str(input_dir))]
    outs = {d["name"]: d for d in event["outputs"]}
    assert set(outs) == {f"{output}/{t}" for t in ("outputs", "ledger", "quarantine")}
    assert {d["namespace"] for d in outs.values()} == {"file"}
    rows = {t: read_kind(output, t, JOB_ID).num_rows for t in ("outputs", "quarantine")}
    for t, n in rows.items():
        assert outs[f"{output}/{t}"]["outputFacets"]["outputStatistics"]["rowCount"] == n
    facet = event["run"]["facets"]["tokenmill_job"]
    assert facet["jobId"] == JOB_ID and facet["status"] == "succeeded"
    assert facet["partitionsCommitted"] == facet["partitions"] and facet["outputs"] == rows["outputs"]
    assert facet["costUsd"] == pytest.approx(sum(read_kind(output, "ledger", JOB_ID)["cost_usd"].to_pylist()))
