"""Nightly summarisation: key -> cluster (CPU, per shard of tenant scopes) -> plan -> prepare (CPU,
per partition) -> drain (GPU, per tier worker) -> commit (CPU, per partition) -> summary -> outcome.
`summary` updates the Assets `nightly_summarization.{outputs,ledger,quarantine}`, named by the tables'
physical URIs under the config's output root (`file:///…/ledger`, `s3://bucket/…/ledger`), each event's
extra naming the job, its output root and what it committed: a downstream DAG is scheduled on them. Where
Airflow's OpenLineage provider is configured, its COMPLETE event carries the job's lineage (input prefix
-> the three tables, row counts, cost: pipeline/job/lineage.py).

Wiring only: every task calls one function of pipeline.job.orchestrate, which is idempotent, so retries
and cleared tasks never pay twice. `prepare[p]` turns a partition's unpaid requests into work units in
the state catalog; each `drain_<tier>` task is one GPU worker of that tier (queue and pool `gpu-<tier>`,
`run.tier_workers` replicas): it starts its tier's engine once and keeps it fed with that tier's units
from every partition, escalations and long-document follow-ups included; `commit[p]` writes a partition
once its last unit is done, with the engines' start-up and idle time shared into its ledger. Re-run a
failed partition by clearing its `prepare` task instance with downstream (docs/ops.md).

Environment: TOKENMILL_CONFIG (default: configs/local.yaml of this checkout) is the default config;
the `config` param overrides it per run. Parsing this file reads only the config's `run:` section, its
tier names and `output.uri`, so the DAG processor needs none of the secrets the rest of the config names.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pendulum
from airflow.sdk import Asset, Param, dag, get_current_context, task

from pipeline.config import load_run_section, load_tier_workers
from pipeline.job import orchestrate

CONFIG = os.environ.get("TOKENMILL_CONFIG", str(Path(__file__).resolve().parents[1] / "configs" / "local.yaml"))
DAG_ID = "nightly_summarization"
RUN = load_run_section(CONFIG)  # schedule and retries; nothing else is read or expanded at parse time
TIER_WORKERS = load_tier_workers(CONFIG)  # tier -> GPU worker tasks
# What `summary` updates, for downstream DAGs to be scheduled on (e.g. dags/ledger_rollup.py): the tables of the
# config's output root, named by their physical URIs, as the OpenLineage datasets of `summary`'s COMPLETE event.
ASSETS = {t: Asset(name=f"{DAG_ID}.{t}", uri=uri) for t, uri in orchestrate.table_asset_uris(CONFIG).items()}
_SUMMARY: dict = {}  # the manifest `summary` returned, in its task process, for its OpenLineage event


def _summary_lineage(task_instance):
    """Airflow's OpenLineage provider calls this when `summary` succeeds (only where the provider is
    installed and a transport configured): input prefix -> the three tables, with rows and cost."""
    from airflow.providers.openlineage.extractors import OperatorLineage

    from pipeline.job.lineage import summary_lineage

    return OperatorLineage(**summary_lineage(_SUMMARY["manifest"])) if "manifest" in _SUMMARY else None


def _job():
    ctx = get_current_context()
    return orchestrate.job_from_params(ctx["params"], DAG_ID, ctx.get("ds"))  # no `ds`: a run with no logical date


@dag(
    dag_id=DAG_ID,
    schedule=RUN.schedule,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    tags=["tokenmill"],
    default_args={
        "retries": RUN.retries,
        "retry_delay": timedelta(seconds=RUN.retry_delay_seconds),
        "retry_exponential_backoff": True,
        "max_retry_delay": timedelta(minutes=15),
    },
    params={
        "config": Param(CONFIG, type="string", description="tokenmill YAML config on the workers"),
        "input_uri": Param(None, type=["null", "string"], description="overrides input.uri; {date} = run date"),
        "output_uri": Param(None, type=["null", "string"], description="overrides output.uri; {date} = run date"),
        "run_date": Param(None, type=["null", "string"], description="YYYY-MM-DD; default: the run's logical date"),
        "job_id": Param(None, type=["null", "string"], description="the job's id; default: <dag id>-<run date>"),
        "tenant": Param(
            None, type=["null", "string"], description="default tenant, and every batch request's (Batch API)"
        ),
        "input_format": Param(
            None, type=["null", "string"], description="auto, records, openai or anthropic: overrides input.format"
        ),
    },
)
def nightly_summarization():
    @task
    def key() -> list[int]:
        return orchestrate.keyed_shards(*_job())

    @task(map_index_template="shard {{ task.op_kwargs['shard'] }}")
    def cluster(shard: int) -> dict:
        return orchestrate.clustered_shard(*_job(), shard)

    @task(trigger_rule="none_failed")  # a rerun of a planned job maps `cluster` over no shard: it is skipped
    def plan() -> list[str]:
        return orchestrate.planned_partitions(*_job())

    @task(map_index_template="{{ partition }}")
    def prepare(partition: str) -> str:
        get_current_context()["partition"] = partition
        orchestrate.prepared_partition(*_job(), partition)
        return partition

    @task(trigger_rule="all_done")  # a partition whose prepare failed never stops the others' GPU work
    def drain(tier: str, replica: int) -> dict:
        return orchestrate.drained_tier(*_job(), tier)

    @task(trigger_rule="all_done", map_index_template="{{ partition }}")
    def commit(partition: str) -> dict:
        get_current_context()["partition"] = partition
        return orchestrate.committed_partition(*_job(), partition)

    @task(trigger_rule="all_done", outlets=list(ASSETS.values()))
    def summary() -> dict:
        manifest = orchestrate.job_manifest(*_job())
        events = get_current_context()["outlet_events"]
        for table, extra in orchestrate.table_updates(manifest).items():
            events[ASSETS[table]].extra = extra
        _SUMMARY["manifest"] = manifest
        return manifest.as_json()  # what XCom carries to `outcome`

    @task
    def outcome(manifest: dict) -> str:
        # A run's state comes from its leaf tasks: this one fails the run when a partition did not commit.
        return orchestrate.job_outcome(manifest)

    partitions = plan()
    cluster.expand(shard=key()) >> partitions
    prepared = prepare.expand(partition=partitions)
    committed = commit.expand(partition=partitions)
    for tier, replicas in TIER_WORKERS.items():
        workers = (
            drain.override(
                task_id=f"drain_{tier}",
                pool=f"gpu-{tier}",
                queue=f"gpu-{tier}",
                map_index_template=f"{tier} {{{{ task.op_kwargs['replica'] }}}}",
            )
            .partial(tier=tier)
            .expand(replica=list(range(replicas)))
        )
        prepared >> workers >> committed
    manifest = summary()
    manifest.operator.get_openlineage_facets_on_complete = _summary_lineage  # what the provider looks for
    committed >> manifest
    outcome(manifest)


nightly_summarization()
