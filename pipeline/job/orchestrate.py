"""What an orchestrator's tasks call: one function per task, each named after what it returns.

The Airflow DAG (dags/nightly_summarization.py) only wires these. Every function is idempotent:
a retry or a cleared task re-runs it without paying twice, because the state catalog and the
paid-for items decide what is left to do. They take plain arguments (paths, URIs, ids) and return
plain JSON-able values, so they pass through XCom and can be called from any scheduler.
"""

from __future__ import annotations

import re
from datetime import date
from decimal import Decimal
from pathlib import Path

from pipeline.config import TokenmillConfig, load_config, load_output_uri
from pipeline.errors import JobError
from pipeline.generate import metrics
from pipeline.job import plan as plan_step
from pipeline.job.commit import commit_partition
from pipeline.job.context import JobContext, check_job_id
from pipeline.job.drain import drain_tier
from pipeline.job.manifest import refresh_manifest
from pipeline.job.preflight import check_isolation
from pipeline.job.prepare import check_budget, prepare
from pipeline.job.progress import Progress
from pipeline.output.manifest import Manifest
from pipeline.stores.catalog import migrate
from pipeline.stores.paths import TABLES


def job_id_for(prefix: str, run_date: str) -> str:
    """One job per scheduled date: `<prefix>-<YYYY-MM-DD>`, so a backfill gives each date its own job."""
    job_id = re.sub(r"[^A-Za-z0-9._-]", "-", f"{prefix}-{run_date}")
    check_job_id(job_id)
    return job_id


def job_config(
    config_path: str,
    run_date: str,
    input_uri: str | None = None,
    output_uri: str | None = None,
    tenant: str | None = None,
    input_format: str | None = None,
) -> TokenmillConfig:
    """The config with the task's URIs; `{date}` in either URI becomes the run date (YYYY-MM-DD). `tenant`: the
    default tenant (of records that name none, and of .txt/.md files), and every batch request's, their own
    `metadata.tenant` ignored (a Batch API batch is its caller's); `input_format`: `input.format` forced."""
    config = load_config(Path(config_path), input__uri=input_uri, output__uri=output_uri)
    config = job_input(config, config.input.uri.replace("{date}", run_date), tenant, input_format)
    config.output.uri = config.output.uri.replace("{date}", run_date)
    return config


def job_input(
    config: TokenmillConfig, input_uri: str, tenant: str | None = None, input_format: str | None = None
) -> TokenmillConfig:
    """`config` for a job reading `input_uri`, its `input.format` forced to `input_format` when given, billed to
    `tenant` when given: the default tenant (of records that name none, and of .txt/.md files) and every batch
    request's, their own `metadata.tenant` ignored (a Batch API batch is its caller's). The one place a job's
    input is set for it: a DAG run's tasks (`job_config`) and the Batch API's runner both build theirs here."""
    fields: dict = {"uri": input_uri}
    if input_format is not None:
        fields["format"] = input_format
    if tenant:
        fields |= {"default_tenant": tenant, "request_tenant": "default"}
    data = config.input.model_dump() | fields
    return config.model_copy(update={"input": type(config.input).model_validate(data)}, deep=True)


def job_from_params(params: dict, dag_id: str, logical_date: str | None) -> tuple[TokenmillConfig, str]:
    """(config, job id) from a DAG run's params: config path, URIs, the run date (default: the logical date,
    else today), the job id (default `<dag id>-<run date>`), the tenant billed and the input's format."""
    run_date = params.get("run_date") or logical_date or date.today().isoformat()
    config = job_config(
        params["config"],
        run_date,
        params.get("input_uri"),
        params.get("output_uri"),
        params.get("tenant"),
        params.get("input_format"),
    )
    job_id = params.get("job_id")
    if job_id is not None:
        check_job_id(job_id)
    # The DAG's runs share one metrics pipeline (one Pushgateway group, the same series every night), its own id.
    config.metrics.pipeline = config.metrics.pipeline or dag_id
    return config, job_id or job_id_for(dag_id, run_date)


def _context(config: TokenmillConfig, job_id: str) -> JobContext:
    return JobContext.open(config, job_id, progress=Progress("log", config.run.log_every_seconds))


def keyed_shards(config: TokenmillConfig, job_id: str) -> list[int]:
    """Planning's first step (claim the planning, key every input file): the shards left to cluster. The
    first task of a run, so the one that brings the catalog to the latest schema; later tasks do not."""
    migrate(config.state.url)
    return plan_step.keyed_shards(_context(config, job_id).planning())


def clustered_shard(config: TokenmillConfig, job_id: str, shard: int) -> dict:
    """One shard's dedup (a CPU task per shard); its figures."""
    return plan_step.clustered_shard(_context(config, job_id).planning(), shard)


def planned_partitions(config: TokenmillConfig, job_id: str) -> list[str]:
    """Plan the job once (from the clustered shards, or all of planning when no shard task ran; later
    calls return the same partitions) and check the budget before GPU work."""
    ctx = _context(config, job_id)
    planning = ctx.planning()
    plan_step.planned_from_shards(planning)
    plan_step.plan(planning)
    partitions = ctx.state.partitions(job_id)
    todo = [p.partition for p in partitions if p.status != "succeeded"]
    if config.budget.active and todo:
        check_budget(ctx.preparing(), todo)
    return [p.partition for p in partitions]


def prepared_partition(config: TokenmillConfig, job_id: str, partition: str) -> dict:
    """CPU side of a partition: paid-item lookup, prompts rendered and tokenised, enqueued as work units."""
    ctx = _context(config, job_id)
    check_isolation(ctx.state, job_id, config)
    preparing = ctx.preparing()
    try:
        return prepare(preparing, partition)
    except Exception as e:
        preparing.waves.fail(partition, f"prepare: {type(e).__name__}: {e}")
        raise


def drained_tier(config: TokenmillConfig, job_id: str, tier: str) -> dict:
    """GPU side: one tier worker, draining its tier's units of every partition; returns its engine time."""
    return drain_tier(_context(config, job_id).draining(), tier)


def committed_partition(config: TokenmillConfig, job_id: str, partition: str) -> dict:
    """CPU side after the GPU: commit the generated partition, return its counts. Raises if it fails."""
    return commit_partition(_context(config, job_id).committing(), partition)


def job_manifest(config: TokenmillConfig, job_id: str) -> Manifest:
    """Write and return the manifest over whatever has committed; never raises for failed partitions. Pushes
    the job's final totals (after every commit task: whichever commit pushed last, this push is the night's)."""
    ctx = _context(config, job_id)
    manifest = refresh_manifest(ctx.manifests())
    metrics.report_job(ctx)
    return manifest


# The tables a job updates (stores/paths.py TABLES) are the orchestrator's assets (Airflow Assets): a downstream
# DAG (an analyst's load into the warehouse, a FinOps export) is scheduled on "the ledger was updated", not on a clock.


def table_asset_uri(output_uri: str, table: str) -> str:
    """The physical URI of one of the tables under an output root (its folder: outputs/, ledger/, quarantine/):
    `file:///abs/path/<table>` for a local root (a relative one resolved against this process's directory, as the
    job's storage does), `s3://bucket/prefix/<table>`. What the Airflow Assets are named by and what the lineage
    datasets name (pipeline/job/lineage.py), so that Airflow maps one onto the other. A `{date}` in the root stays
    as written: the Asset of a dated root names every date's table; each event's extra names the root it updated."""
    if table not in TABLES:
        raise ValueError(f"no table {table!r} (tables: {', '.join(TABLES)})")
    root = output_uri.rstrip("/")
    if "://" not in root:
        root = "file://" + str(Path(root).expanduser().resolve())
    return f"{root}/{table}"


def table_asset_uris(config_path: str | Path) -> dict[str, str]:
    """table -> its Asset URI under the config's output root (`output.uri`, read alone: parsing the DAG needs no
    secret of the rest of the config)."""
    return {t: table_asset_uri(load_output_uri(config_path), t) for t in TABLES}


def table_updates(manifest: Manifest) -> dict[str, dict]:
    """table -> what one asset event says of it: which job and output root, the partitions committed so
    far, the job's rows in it (outputs, quarantine) or its cost (ledger). JSON-able: the event's `extra`."""
    counts, cost = manifest.counts, manifest.cost
    common = {
        "job_id": manifest.job_id,
        "output_uri": manifest.output_uri,
        "status": manifest.status,
        "partitions_committed": len(manifest.committed()),
        "partitions": len(manifest.partitions),
    }
    return {
        "outputs": {**common, "rows": counts.outputs},
        "ledger": {**common, "cost_usd": cost.cost_usd, "gpu_seconds": cost.gpu_seconds},
        "quarantine": {**common, "rows": counts.quarantined},
    }


def cost_rollup(config_path: str, output_uri: str, job_id: str) -> dict:
    """One job's items, tokens, GPU-seconds and cost by tenant and tier, read from the committed ledger
    (what a downstream DAG scheduled on the ledger asset computes); numbers as plain floats and ints."""
    from pipeline.output.ledger import connect, summary

    config = load_config(Path(config_path))
    table = summary(connect(output_uri, config.storage), ["tenant", "tier"], job_id)
    # DuckDB's sums of decimals are Decimals, which an orchestrator's XCom need not carry.
    rows = [{k: float(v) if isinstance(v, Decimal) else v for k, v in r.items()} for r in table.to_pylist()]
    return {"job_id": job_id, "output_uri": output_uri, "by_tenant_tier": rows}


def job_outcome(manifest: dict) -> str:
    """'succeeded', or raise naming the partitions that did not commit (the run's final, failing task; `manifest`:
    what the summary task handed on, `Manifest.as_json`)."""
    partitions = Manifest.parse(manifest).partitions
    bad = {p: v.status for p, v in partitions.items() if v.status != "succeeded"}
    if bad:
        raise JobError(
            f"{len(bad)} of {len(partitions)} partitions not committed: "
            + ", ".join(f"{p} {s}" for p, s in sorted(bad.items()))
        )
    return "succeeded"
