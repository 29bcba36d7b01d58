"""The nightly DAG under a real deployment (tests/airflow_deploy.py): what its tests share.

The services' tokenmill environment, and what a run left behind, read the way ops would read it: the
manifest, the partitions' commits in the Delta tables, the ledger by partition, the items paid for, and what
each drain task returned. Both deployment tests (LocalExecutor, CeleryExecutor) check the same promises with these.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path

from tests.airflow_deploy import AirflowDeployment, airflow_database, fault_hook_env
from tests.conftest import FAKE_ENGINE, REPO, TINY_CONFIG, read_kind

DAG_ID = "nightly_summarization"
# What every task process imports (the DAG's module, the fake engine's tokenizer class): the scheduler
# (or a Celery worker) imports them once and its task processes inherit them, instead of paying seconds each.
PRELOAD = ("pipeline.job.orchestrate", "pipeline.generate.fake_engine", "transformers.tokenization_utils_tokenizers")


def job_id(run_date: str) -> str:
    return f"{DAG_ID}-{run_date}"


def tokenmill_env(tmp_path: Path, records_per_partition: int, tier_workers: dict[str, int]) -> dict[str, str]:
    """The services' (so every task process's) tokenmill settings: state, cache and faults in `tmp_path`,
    the tier workers per tier, no retries (a failure fails its task at once), the fake engine."""
    return {
        "TOKENMILL_HOME": os.environ["TOKENMILL_HOME"],  # the tiny models (conftest)
        "TOKENMILL_CONFIG": str(TINY_CONFIG),  # the DAG's shape at parse time: tier names, run section
        "TOKENMILL_STATE__URL": f"sqlite:///{tmp_path}/state.db",
        "TOKENMILL_CACHE__PATH": str(tmp_path / "cache"),
        "TOKENMILL_INPUT__RECORDS_PER_PARTITION": str(records_per_partition),
        "TOKENMILL_RUN__TIER_WORKERS": json.dumps(tier_workers),
        "TOKENMILL_RUN__RETRIES": "0",
        "TOKENMILL_RUN__PROGRESS": "log",
        **FAKE_ENGINE,  # Airflow is what is tested here; the tier workers drain the fake engine
        **fault_hook_env(tmp_path / "hook", tmp_path / "faults.json"),
    }


@contextlib.contextmanager
def deployment(
    tmp_path: Path,
    admin_url: str,
    env: dict[str, str],
    pools: dict[str, int],
    dags: tuple[str, ...] = (DAG_ID,),
    workers: tuple = (),
    **options,
) -> Iterator[AirflowDeployment]:
    """The repo's DAGs on a real Airflow deployment over a throwaway metadata database on `admin_url`: `env` in
    every service's (so every task process's) environment, the GPU pools `gpu-<tier>` with `pools[tier]`
    slots, the Celery `workers` ((name, compose service, kwargs) each) started, `dags` parsed and unpaused.
    `options`: AirflowDeployment's (executor, broker_url, ...)."""
    with airflow_database(admin_url) as db:
        af = AirflowDeployment(
            tmp_path / "airflow",
            REPO / "dags",
            db,
            env=env,
            drop_env=("AIRFLOW", "TOKENMILL_"),
            preload=PRELOAD,
            **options,
        )
        af.start()
        try:
            for tier, slots in pools.items():
                af.create_pool(f"gpu-{tier}", slots, f"{tier} tier GPUs")
            for name, service, kwargs in workers:
                af.start_worker(name, service, **kwargs)
            for dag_id in dags:
                af.wait_for_dag(dag_id)
                af.unpause(dag_id)
            yield af
        finally:
            af.stop()


def manifest(output: Path, job: str) -> dict:
    return json.loads((output / "jobs" / job / "manifest.json").read_text())


def partition_commits(output: Path, job: str) -> dict[str, tuple]:
    """partition -> what its commit is in the tables: the claim epoch of each, and the files their logs name."""
    import pyarrow as pa

    from pipeline.output.tables import KINDS, open_table
    from pipeline.stores import storage

    root = storage.resolve(str(output))
    out: dict[str, tuple] = {}
    for kind in KINDS:
        table = open_table(root, kind)
        for action in pa.table(table.get_add_actions(flatten=True)).to_pylist() if table is not None else []:
            if action["partition.job_id"] == job:
                p = action["partition.partition"]
                epoch = table.transaction_version(f"{job}/{p}")
                out[p] = (*out.get(p, ()), (kind, epoch, action["path"]))
    return {p: tuple(sorted(v)) for p, v in out.items()}


def ledger_by_partition(output: Path, job: str) -> dict[str, list[tuple]]:
    """partition -> its ledger rows (kind, id, gpu_seconds), sorted."""
    out: dict[str, list[tuple]] = {}
    for row in read_kind(output, "ledger", job).select(["partition", "kind", "id", "gpu_seconds"]).to_pylist():
        out.setdefault(row["partition"], []).append((row["kind"], row["id"] or "", row["gpu_seconds"]))
    return {p: sorted(rows) for p, rows in out.items()}


def paid_items(state_db: Path, job: str) -> dict[str, int]:
    """partition -> paid-for items (generations) the catalog holds for it."""
    with sqlite3.connect(state_db, timeout=30) as c:
        return dict(c.execute("select partition, count(*) from items where job_id=? group by partition", (job,)))


def drain_reports(af: AirflowDeployment, run_id: str, tier_workers: dict[str, int]) -> dict[str, list[dict]]:
    """tier -> what each of its drain tasks returned (units, engine_started, worker, ...)."""
    return {
        tier: [af.xcom(DAG_ID, run_id, f"drain_{tier}", i) or {} for i in range(n)] for tier, n in tier_workers.items()
    }


def check_engine_starts(drains: dict[str, list[dict]]) -> dict[str, int]:
    """A drain worker starts its tier's engine once if it had work, and not at all if not. Returns starts
    per tier."""
    for tier, reports in drains.items():
        assert all(r.get("engine_started") == (r.get("units", 0) > 0) for r in reports), (tier, reports)
    return {tier: sum(1 for r in reports if r.get("units", 0) > 0) for tier, reports in drains.items()}


def check_ledger_is_held_time(output: Path, job: str) -> None:
    """The ledger carries exactly the engines' held time x GPUs (start-up, idle and lost work included)."""
    import pytest

    from pipeline.config import load_config

    config = load_config(TINY_CONFIG)
    held = sum(e["held_seconds"] * config.tiers[tier].gpus for tier, e in manifest(output, job)["engines"].items())
    charged = sum(read_kind(output, "ledger", job)["gpu_seconds"].to_pylist())
    assert held > 0 and charged == pytest.approx(held, rel=1e-6), manifest(output, job)["engines"]
