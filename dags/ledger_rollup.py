"""Ledger rollup: runs whenever the nightly DAG has updated the ledger Asset, not on a clock.

An example of a downstream DAG analysts schedule on tokenmill's Assets: for each ledger update it was
triggered by, the job's cost by tenant and tier, as the task's result (where a team's own DAG would load
it into its warehouse). Wiring only: the logic is pipeline.job.orchestrate.cost_rollup.

Environment: TOKENMILL_CONFIG, as for the nightly DAG (the storage settings that read the output root).
"""

from __future__ import annotations

import os
from pathlib import Path

import pendulum
from airflow.sdk import Asset, dag, get_current_context, task

from pipeline.job import orchestrate

CONFIG = os.environ.get("TOKENMILL_CONFIG", str(Path(__file__).resolve().parents[1] / "configs" / "local.yaml"))
# The nightly DAG's ledger Asset, named as it names it (the same config's output root).
LEDGER = Asset(name="nightly_summarization.ledger", uri=orchestrate.table_asset_uris(CONFIG)["ledger"])


@dag(
    dag_id="ledger_rollup",
    schedule=[LEDGER],
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["tokenmill", "analyst"],
)
def ledger_rollup():
    @task
    def rollup() -> list[dict]:
        events = get_current_context()["triggering_asset_events"][LEDGER]
        return [orchestrate.cost_rollup(CONFIG, e.extra["output_uri"], e.extra["job_id"]) for e in events]

    rollup()


ledger_rollup()
