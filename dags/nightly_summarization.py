"""Nightly summarisation: stage -> prepare (CPU, per partition) -> generate (GPU, per partition) -> summary -> outcome.

Wiring only: every task calls one function of pipeline.job.orchestrate, which is idempotent, so retries
and cleared tasks never pay twice. Re-run a failed partition by clearing its `generate` task
instance with downstream (UI, or REST clearTaskInstances); see docs/ops.md.

Environment: TOKENMILL_CONFIG (default: configs/local.yaml of this checkout) is the default config;
the `config` param overrides it per run. Parsing this file reads only the config's `run:` section (schedule,
retries), so the DAG processor needs none of the secrets the rest of the config names.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pendulum
from airflow.sdk import Param, dag, get_current_context, task

from pipeline.config import load_run_section
from pipeline.job import orchestrate

CONFIG = os.environ.get("TOKENMILL_CONFIG", str(Path(__file__).resolve().parents[1] / "configs" / "local.yaml"))
DAG_ID = "nightly_summarization"
RUN = load_run_section(CONFIG)  # schedule and retries; nothing else is read or expanded at parse time


def _job():
    ctx = get_current_context()
    return orchestrate.job_from_params(ctx["params"], DAG_ID, ctx["ds"])


@dag(
    dag_id=DAG_ID,
    schedule=RUN.schedule,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    tags=["tokenmill"],
    default_args={"retries": RUN.retries, "retry_delay": timedelta(seconds=RUN.retry_delay_seconds),
                  "retry_exponential_backoff": True, "max_retry_delay": timedelta(minutes=15)},
    params={
        "config": Param(CONFIG, type="string", description="tokenmill YAML config on the workers"),
        "input_uri": Param(None, type=["null", "string"], description="overrides input.uri; {date} = run date"),
        "output_uri": Param(None, type=["null", "string"], description="overrides output.uri; {date} = run date"),
        "run_date": Param(None, type=["null", "string"], description="YYYY-MM-DD; default: the run's logical date"),
    },
)
def nightly_summarization():
    @task
    def stage() -> list[str]:
        return orchestrate.staged_partitions(*_job())

    @task(map_index_template="{{ partition }}")
    def prepare(partition: str) -> str:
        get_current_context()["partition"] = partition
        orchestrate.prepared_partition(*_job(), partition)
        return partition

    @task(pool="gpu", queue="gpu", map_index_template="{{ partition }}")
    def generate(partition: str) -> dict:
        get_current_context()["partition"] = partition
        return orchestrate.committed_partition(*_job(), partition)

    @task(trigger_rule="all_done")
    def summary() -> dict:
        return orchestrate.job_manifest(*_job())

    @task
    def outcome(manifest: dict) -> str:
        # A run's state comes from its leaf tasks: this one fails the run when a partition did not commit.
        return orchestrate.job_outcome(manifest)

    generated = generate.expand(partition=prepare.expand(partition=stage()))
    manifest = summary()
    generated >> manifest
    outcome(manifest)


nightly_summarization()
