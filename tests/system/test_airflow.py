"""The nightly DAG under real Airflow 3: DagBag, and dag.test() (on the fake engine: Airflow is what is tested
here), failure and re-run."""

import json
import os
import subprocess
import sys

import pytest

from pipeline.dev.samples import write_sample_corpus
from pipeline.stores.catalog import StateStore
from tests.conftest import FAKE_ENGINE, ONE_TIER, REPO, TINY_CONFIG, read_kind
from tests.jobs import assert_exactly_once

DAG_ID = "nightly_summarization"


@pytest.fixture(scope="module")
def airflow_home(tmp_path_factory, tiny_models):
    """A migrated Airflow metadata DB and this repo's dags/ folder; env set before Airflow is imported."""
    home = tmp_path_factory.mktemp("airflow-home")
    os.environ.update(
        {
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "TOKENMILL_RUN__RETRIES": "0",
        }
    )
    subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], check=True, capture_output=True, cwd=home)
    from airflow.models.pool import Pool

    for tier in ("small", "large"):  # the tiers of configs/local.yaml, which shapes the DAG at parse time
        Pool.create_or_update_pool(f"gpu-{tier}", slots=1, description=f"{tier} tier workers", include_deferred=False)
    return home


@pytest.fixture(scope="module")
def dag(airflow_home):
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(REPO / "dags"))
    assert bag.import_errors == {}
    return bag.get_dag(DAG_ID)


def test_dagbag_has_one_gpu_task_per_tier_worker_on_its_own_queue_and_pool(dag):
    assert {t.pool for t in dag.tasks} <= {"default_pool", "gpu-small", "gpu-large"}
    for tier in ("small", "large"):
        drain = dag.get_task(f"drain_{tier}")
        assert drain.pool == f"gpu-{tier}" and drain.queue == f"gpu-{tier}" and drain.trigger_rule == "all_done"
        assert {t.task_id for t in drain.upstream_list} == {"prepare"}
        assert {t.task_id for t in drain.downstream_list} == {"commit"}
    assert dag.get_task("prepare").queue == dag.get_task("commit").queue == "default"  # CPU workers
    assert dag.catchup is False and dag.params["config"] is not None
    # Planning: keyed once, a CPU task per shard of tenant scopes, then the plan registered once.
    assert {t.task_id for t in dag.get_task("cluster").upstream_list} == {"key"}
    assert {t.task_id for t in dag.get_task("plan").upstream_list} == {"cluster"}
    assert dag.get_task("cluster").queue == "default"


def test_dag_runs_end_to_end_then_a_failed_partition_reruns_alone(dag, tmp_path, monkeypatch):
    import pendulum

    from pipeline.job import faults

    counts = write_sample_corpus(tmp_path / "input", documents=20)
    monkeypatch.setenv("TOKENMILL_STATE__URL", f"sqlite:///{tmp_path}/state.db")
    monkeypatch.setenv("TOKENMILL_CACHE__PATH", str(tmp_path / "cache"))
    for name, value in {**ONE_TIER, **FAKE_ENGINE}.items():  # one tier here; routing is tested in test_routing.py
        monkeypatch.setenv(name, value)
    conf = {"config": str(TINY_CONFIG), "input_uri": str(tmp_path / "input"), "output_uri": str(tmp_path / "output")}
    day = pendulum.datetime(2026, 11, 29, tz="UTC")
    job_id = f"{DAG_ID}-2026-11-29"

    victim = {}

    def fail_one(point, job, partition):
        if not partition:  # a job-level point (planning's): this test fails one partition
            return
        victim.setdefault("p", partition)
        if partition == victim["p"]:
            raise OSError("GPU worker lost")

    with faults.inject(fail_one):
        run = dag.test(logical_date=day, run_conf=conf)
    assert run.state == "failed"  # the outcome task fails the run
    states = {(ti.task_id, ti.rendered_map_index): ti.state for ti in run.get_task_instances()}
    assert states[("prepare", victim["p"])] == "failed"  # the mapped task is named by its partition
    assert states[("commit", victim["p"])] == "failed"
    assert {v for (t, _), v in states.items() if t.startswith("drain_")} == {"success"}  # the others' GPU work went on
    assert states[("summary", None)] == "success" and states[("outcome", None)] == "failed"
    shards = sorted(i for t, i in states if t == "cluster")
    assert shards and all(states[("cluster", i)] == "success" for i in shards)  # three tenants: a shard each or fewer
    state = StateStore(f"sqlite:///{tmp_path}/state.db")
    before = {p.partition: (p.status, p.attempts) for p in state.partitions(job_id)}
    assert before[victim["p"]] == ("failed", 0)  # failed in prepare: never claimed for a commit

    # The worker is back; Airflow runs the date again (dag.test clears the run's task instances).
    run = dag.test(logical_date=day, run_conf=conf)
    assert run.state == "success"
    after = {p.partition: (p.status, p.attempts) for p in state.partitions(job_id)}
    assert after[victim["p"]] == ("succeeded", 1)
    assert all(after[p] == before[p] for p in before if p != victim["p"])  # committed partitions: not re-run
    assert_exactly_once(tmp_path / "output", job_id, counts, tmp_path / "state.db")
    staged = json.loads((tmp_path / "output" / "jobs" / job_id / "manifest.json").read_text())["staging"]
    assert staged["shards"] == len(shards) and staged["records"] == counts["documents"] + counts["bad_records"]

    # Outputs and ledger as from `tokenmill run`: same schema, one row per valid record.
    from pipeline.output.tables import SCHEMAS
    from pipeline.schema import LEDGER

    assert read_kind(tmp_path / "output", "outputs", job_id).schema.equals(SCHEMAS["outputs"])
    assert read_kind(tmp_path / "output", "ledger", job_id).schema.equals(LEDGER)
