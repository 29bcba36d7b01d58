"""The job: read -> validate -> dedup -> route -> plan -> infer -> write, each stage a function over Arrow tables.

`run_job` is the one entry point the CLI and the DAGs call. It owns no logic of its own beyond
wiring, timing the stages, keeping the accounting invariant and recording the job in the catalog.
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone

import pyarrow as pa
import pyarrow.compute as pc

from pipeline import storage
from pipeline.config import TokenmillConfig
from pipeline.cost import allocate_gpu_seconds, baseline_gpu_seconds, total
from pipeline.dedup import mark_duplicates
from pipeline.infer import EnginePool, run_inference
from pipeline.plan import plan_requests
from pipeline.progress import Progress
from pipeline.read import read_records
from pipeline.route import assign_tiers
from pipeline.state import StateStore
from pipeline.validate import validate_records
from pipeline.write import assemble_results, count_by, write_manifest, write_partitions

log = logging.getLogger(__name__)
JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class JobError(RuntimeError):
    """A job that could not finish; the message is the one-line reason."""


@dataclass
class JobResult:
    job_id: str
    manifest: dict


def new_job_id() -> str:
    return f"job-{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}-{secrets.token_hex(3)}"


class _Timer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str):
        started = time.perf_counter()
        yield
        self.seconds[name] = round(time.perf_counter() - started, 4)


def run_job(config: TokenmillConfig, job_id: str | None = None, pool: EnginePool | None = None,
            progress: Progress | None = None) -> JobResult:
    """Run one job to the end. Raises JobError with a one-line reason when it cannot finish."""
    job_id = job_id or new_job_id()
    if not JOB_ID.match(job_id):
        raise JobError(f"job id {job_id!r} must be 1-128 characters of letters, digits, '.', '_' or '-'")
    state = StateStore(config.state.url)
    state.job_started(job_id, config.fingerprint(), config.input.uri, config.output.uri)
    try:
        manifest = _run(config, job_id, pool or EnginePool(config.tiers), progress or Progress("off"))
    except Exception as e:
        reason = f"{type(e).__name__}: {e}" if not isinstance(e, (JobError, storage.StorageError)) else str(e)
        state.job_finished(job_id, "failed", error=reason)
        raise JobError(reason) from e
    state.job_finished(job_id, "succeeded", counts=manifest["counts"])
    return JobResult(job_id, manifest)


def _run(config: TokenmillConfig, job_id: str, pool: EnginePool, progress: Progress) -> dict:
    started_at = datetime.now(timezone.utc)
    timer = _Timer()
    out_root = storage.resolve(config.output.uri)

    with timer.stage("read"):
        raw, skipped = read_records(config.input.uri, config.input)
    for path in skipped:
        log.warning("skipped %s: not .jsonl, .jsonl.gz, .parquet, .txt or .md", path)
    with timer.stage("validate"):
        records, quarantine = validate_records(raw, config.input, job_id)
    with timer.stage("dedup"):
        records = mark_duplicates(records, config.dedup)
    with timer.stage("route"):
        records = assign_tiers(records, config.route)
    with timer.stage("plan"):
        tiers_used = sorted(set(records["tier"].to_pylist()))
        requests, too_long = plan_requests(records, config.prompt, config.sampling, config.plan,
                                           {t: pool.tokenizer(t) for t in tiers_used},
                                           {t: pool.context_length(t) for t in tiers_used})

    # Progress: a call's items are done together with every duplicate that reuses them.
    copies = Counter(r or i for i, r in zip(records["id"].to_pylist(), records["duplicate_of"].to_pylist()))
    progress.start(raw.num_rows)
    progress.advance(quarantined=quarantine.num_rows + sum(copies[i] for i in too_long["id"].to_pylist()))

    def on_call_done(done: pa.Table, seconds: float) -> None:
        n = sum(copies[i] for i in done["id"].to_pylist())
        tier = config.tiers[done["tier"][0].as_py()] if done.num_rows else None
        usd = seconds * tier.gpus * tier.price_per_gpu_hour / 3600 if tier else 0.0
        progress.advance(done=n, reused=n - done.num_rows, usd=usd)

    with timer.stage("infer"):
        try:
            completions, calls, engine_errors = run_inference(requests, pool, config.sampling, on_call_done)
        finally:
            progress.finish()

    with timer.stage("write"):
        gpu_seconds = allocate_gpu_seconds(completions, calls, config.tiers, config.cost)
        baseline = baseline_gpu_seconds(completions, gpu_seconds, config.largest_tier, config.cost)
        failed = {i: ("too_long", d) for i, d in zip(too_long["id"].to_pylist(), too_long["detail"].to_pylist())}
        failed |= {i: ("engine_error", d) for i, d in zip(engine_errors["id"].to_pylist(),
                                                          engine_errors["detail"].to_pylist())}
        outputs, ledger, late_quarantine = assemble_results(records, completions, gpu_seconds, baseline, failed,
                                                            config, job_id, started_at)
        quarantine = pa.concat_tables([quarantine, late_quarantine])
        if outputs.num_rows + quarantine.num_rows != raw.num_rows:  # the invariant every row depends on
            raise JobError(f"accounting mismatch: {outputs.num_rows} outputs + {quarantine.num_rows} quarantined "
                           f"!= {raw.num_rows} records read; nothing was written")
        partitions = sorted(set(raw["partition"].to_pylist()))
        write_partitions(out_root, job_id, partitions,
                         {"outputs": outputs, "ledger": ledger, "quarantine": quarantine}, config.output.compression)

    manifest = build_manifest(config, job_id, raw, outputs, ledger, quarantine, calls, skipped, timer.seconds,
                              started_at)
    write_manifest(out_root, job_id, manifest)
    return manifest


def build_manifest(config: TokenmillConfig, job_id: str, raw: pa.Table, outputs: pa.Table, ledger: pa.Table,
                   quarantine: pa.Table, calls: pa.Table, skipped: list[str], stage_seconds: dict,
                   started_at: datetime) -> dict:
    engines = {}
    for tier in sorted(set(calls["tier"].to_pylist())):
        tier_calls = calls.filter(pc.equal(calls["tier"], tier))
        tier_ledger = ledger.filter(pc.equal(ledger["tier"], tier))
        seconds = total(tier_calls, "seconds")
        engines[tier] = {
            "model": config.tiers[tier].model, "gpus": config.tiers[tier].gpus, "calls": tier_calls.num_rows,
            "engine_seconds": seconds, "gpu_seconds": seconds * config.tiers[tier].gpus,
            "failed_attempts": int(total(tier_calls, "failed_attempts")),
            "output_tokens_per_second": total(tier_ledger, "output_tokens") / seconds if seconds else None,
        }
    partitions = {}
    for part, file in zip(raw["partition"].to_pylist(), raw["file"].to_pylist()):
        partitions.setdefault(part, {"file": file, "records": 0})["records"] += 1
    cost, baseline = total(ledger, "cost_usd"), total(ledger, "baseline_cost_usd")
    return {
        "job_id": job_id,
        "status": "succeeded",
        "config_fingerprint": config.fingerprint(),
        "input_uri": config.input.uri,
        "output_uri": config.output.uri,
        "template_version": config.prompt.template_version,
        "started_at": started_at.isoformat(),
        "finished_at": datetime.now(timezone.utc).isoformat(),
        "stage_seconds": stage_seconds,
        "counts": {
            "records": raw.num_rows,
            "outputs": outputs.num_rows,
            "quarantined": quarantine.num_rows,
            "by_source": count_by(outputs, "source"),
            "by_reason": count_by(quarantine, "reason"),
            "by_tier": count_by(outputs, "tier"),
        },
        "tokens": {name: int(total(ledger, name)) for name in ("prompt_tokens", "cached_prompt_tokens", "output_tokens")},
        "cost": {"cost_usd": cost, "baseline_cost_usd": baseline, "saved_usd": baseline - cost,
                 "gpu_seconds": total(ledger, "gpu_seconds")},
        "engines": engines,
        "partitions": partitions,
        "skipped_files": skipped,
    }
