"""The job manifest: what a job read, produced, paid and saved, summed from its committed partitions.

Each partition stores its own counts when it commits (`partition_counts`); the manifest adds them
up (`build_manifest`), so any worker can write it, and a rerun's manifest covers the whole job.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.config import TokenmillConfig, redact_url
from pipeline.generate.levers import lever_summary, ratio
from pipeline.generate.quality import CHECKS
from pipeline.generate.shadow import summarise_verification
from pipeline.output.batch import write_batch_results
from pipeline.output.manifest import (
    CommitRecord,
    JobCounts,
    JudgeCounts,
    Manifest,
    ManifestCost,
    ManifestCounts,
    PartitionCounts,
    PartitionEntry,
    PrefixCache,
    Reuse,
    ReusedBy,
    Tokens,
    Unfaithful,
)
from pipeline.output.tables import StagedFileGone, publish, published_epochs
from pipeline.output.telemetry import decode_steps, tier_efficiency
from pipeline.output.write import count_by, write_manifest
from pipeline.stores import storage
from pipeline.stores.catalog import StateStore, aware, now
from pipeline.stores.units import SESSION_COUNTERS, UnitQueue


@dataclass(frozen=True)
class ManifestSources:
    """What the manifest write uses, and only that (built by the job's context, `JobContext.manifests`)."""

    config: TokenmillConfig
    job_id: str
    state: StateStore  # the job's row and its partitions' counts
    queue: UnitQueue  # the job's engine sessions
    out: storage.Location  # where the tables are published and the manifest written


def partition_counts(
    outputs: pa.Table, ledger: pa.Table, quarantine: pa.Table, items: dict[str, dict], config: TokenmillConfig
) -> PartitionCounts:
    """What a committed partition contributes to the job's totals (stored with the partition)."""

    def s(table, col):
        return float(pc.sum(table[col]).as_py() or 0) if table.num_rows else 0.0

    engines: dict[str, dict] = {}
    served = ledger.filter(pc.equal(ledger["kind"], "output")) if ledger.num_rows else ledger
    partition = outputs["partition"][0].as_py() if outputs.num_rows else None
    for item in items.values():  # what this partition's generations asked of each tier's engine
        if item.get("origin") is not None or item.get("partition") != partition or item["tier"] not in config.tiers:
            continue
        e = engines.setdefault(
            item["tier"],
            {
                "items": 0,
                "output_tokens": 0,
                "uncached_prompt_tokens": 0,
                "busy_gpu_seconds": 0.0,
                "decode_steps_estimate": 0,
            },
        )
        e["items"] += 1
        e["output_tokens"] += item["output_tokens"]
        e["uncached_prompt_tokens"] += item["prompt_tokens"] - item["cached_prompt_tokens"]
        e["busy_gpu_seconds"] += item["gpu_seconds"]
    for tier, e in engines.items():
        e["decode_steps_estimate"] = decode_steps(
            e["items"], e["output_tokens"] / e["items"], config.tiers[tier].vllm.max_num_seqs
        )
    kinds = ledger.filter(pc.equal(ledger["kind"], "failed_attempt"))
    for tier in set(kinds["tier"].to_pylist()):
        e = engines.setdefault(
            tier,
            {
                "items": 0,
                "output_tokens": 0,
                "uncached_prompt_tokens": 0,
                "busy_gpu_seconds": 0.0,
                "decode_steps_estimate": 0,
            },
        )
        e["failed_attempts"] = kinds.filter(pc.equal(kinds["tier"], tier)).num_rows
    # Through JSON, as the catalog stores it: a ledger row without a route reason or source counts under "null".
    counts = {
        "records": outputs.num_rows + quarantine.num_rows,
        "outputs": outputs.num_rows,
        "quarantined": quarantine.num_rows,
        "by_source": count_by(outputs, "source"),
        "by_reason": count_by(quarantine, "reason"),
        "by_tier": count_by(outputs, "tier"),
        "tokens": {k: int(s(ledger, k)) for k in ("prompt_tokens", "cached_prompt_tokens", "output_tokens")},
        "cost_usd": s(ledger, "cost_usd"),
        "baseline_cost_usd": s(ledger, "baseline_cost_usd"),
        "gpu_seconds": s(ledger, "gpu_seconds"),
        "engines": engines,
        "gpu_seconds_by_kind": {
            k: s(ledger.filter(pc.equal(ledger["kind"], k)), "gpu_seconds") for k in count_by(ledger, "kind")
        },
        "overhead_gpu_seconds": s(ledger, "overhead_gpu_seconds"),
        "saved_by_source": {
            src: s(ledger.filter(pc.equal(ledger["source"], src)), "saved_cost_usd")
            for src in count_by(ledger, "source")
            if src != "generated"
        },
        "cache_status": count_by(ledger.filter(pc.is_valid(ledger["cache_status"])), "cache_status"),
        "routing": {
            "by_reason": count_by(ledger, "route_reason"),
            "escalated": int(pc.sum(ledger["escalated"].cast(pa.int64())).as_py() or 0) if ledger.num_rows else 0,
            "chunked": int(pc.sum(pc.greater(ledger["chunks"], 0).cast(pa.int64())).as_py() or 0)
            if ledger.num_rows
            else 0,
            "escalated_by": count_by(ledger.filter(pc.is_valid(ledger["escalation_reason"])), "escalation_reason"),
        },
        # Served outputs that state numbers, dates or names their documents lack (on the largest tier, or
        # left unescalated): what a reader should check first.
        "unfaithful": {"outputs": count_by(ledger.filter(pc.fill_null(ledger["unfaithful"], False)), "tier")},
        # Served outputs that failed an output check (docs/data-engineer.md#output-checks), per tier (a record
        # quarantined by `checks.quarantine` is counted by its quarantine reason instead).
        "checks": {check: count_by(served.filter(pc.fill_null(served[check], False)), "tier") for check in CHECKS},
        # Served outputs no check failed (ledger column `acceptable`), per tier: what a buyer pays for.
        "acceptable": count_by(served.filter(pc.fill_null(served["acceptable"], False)), "tier"),
        "judge": judge_counts(served, ledger),
    }
    return PartitionCounts.model_validate_json(json.dumps(counts))


def judge_counts(served: pa.Table, ledger: pa.Table) -> dict:
    """The LLM judge's part (checks.judge): served outputs it was asked about, by verdict (generate/judge.py
    VERDICTS), and the verdicts this partition paid for (ledger rows of kind `judge`: a duplicate's or the cache's
    cost nothing) with their GPU-seconds and cost."""
    if not ledger.num_rows or "judge" not in served.column_names:
        return {"judged": 0, "verdicts": {}, "paid": 0, "gpu_seconds": 0.0, "cost_usd": 0.0}
    asked = served.filter(pc.is_valid(served["judge"]))
    paid = ledger.filter(pc.equal(ledger["kind"], "judge"))
    return {
        "judged": asked.num_rows,
        "verdicts": count_by(asked, "judge"),
        "paid": paid.num_rows,
        "gpu_seconds": float(pc.sum(paid["gpu_seconds"]).as_py() or 0),
        "cost_usd": float(pc.sum(paid["cost_usd"]).as_py() or 0),
    }


def prefix_cache(tokens: Tokens) -> PrefixCache:
    """Prompt tokens served from vLLM's prefix cache, next to the share that prefix sharing allows in theory
    (each request's common prefix with the one before it in request order; the engine caches whole blocks,
    so it reaches a little less)."""
    prompt, cached, shareable = tokens.prompt_tokens, tokens.cached_prompt_tokens, tokens.shareable_prompt_tokens
    return PrefixCache(
        hit_ratio=round(cached / prompt, 4) if prompt else None,
        shareable_ratio=round(shareable / prompt, 4) if prompt else None,
        of_shareable=round(cached / shareable, 4) if shareable else None,
    )


def _add(total: dict, part: dict) -> dict:
    for k, v in part.items():
        if isinstance(v, dict):
            _add(total.setdefault(k, {}), v)
        elif isinstance(v, list):
            total.setdefault(k, []).extend(v)
        else:
            total[k] = total.get(k, 0) + v
    return total


def engine_time(sessions: list) -> dict[str, dict]:
    """Per tier, from the job's engine sessions: engine starts and workers, start-up, busy, idle and held
    seconds (held × GPUs is what the ledger adds up to), and utilisation = busy / held."""
    out: dict[str, dict] = {}
    for s in sessions:
        e = out.setdefault(
            s.tier,
            {
                "workers": 0,
                "starts": 0,
                "startup_seconds": 0.0,
                "busy_seconds": 0.0,
                "idle_seconds": 0.0,
                "held_seconds": 0.0,
                "held_gpu_seconds": 0.0,
            },
        )
        e["workers"] += 1
        e["starts"] += s.started
        for k in ("startup_seconds", "busy_seconds", "idle_seconds"):
            e[k] += getattr(s, k)
        e["held_seconds"] += s.held_seconds
        e["held_gpu_seconds"] += s.held_seconds * s.gpus
        for k in SESSION_COUNTERS:  # the engine's own counts, per session (None: not kept)
            if getattr(s, k, None) is not None:
                e[k] = (e.get(k) or 0) + getattr(s, k)
    for e in out.values():
        e["utilisation"] = round(e["busy_seconds"] / e["held_seconds"], 4) if e["held_seconds"] else None
    return out


def engine_figures(config: TokenmillConfig, engines: dict, sessions: list) -> dict:
    """Per tier: the committed items' engine figures (`engines`) with the engine time its sessions held,
    throughput, vLLM's own counters, efficiency against the hardware and the levers in use."""
    held = engine_time(sessions)
    for tier in held:
        engines.setdefault(
            tier,
            {
                "items": 0,
                "output_tokens": 0,
                "uncached_prompt_tokens": 0,
                "busy_gpu_seconds": 0.0,
                "decode_steps_estimate": 0,
            },
        )
    for tier, e in engines.items():
        e.update(held.get(tier, {}))
        e["engine_seconds"] = e.get("busy_seconds", 0.0)  # what the efficiency figures divide by
        e["gpu_seconds"] = e.get("held_gpu_seconds", 0.0)
        e["model"] = config.tiers[tier].generator if tier in config.tiers else None
        e["output_tokens_per_second"] = e["output_tokens"] / e["engine_seconds"] if e["engine_seconds"] else None
        # vLLM's own counters: drafted tokens accepted, prompt tokens the prefix cache had (None: not measured)
        e["spec_acceptance"] = ratio(e.get("spec_accepted"), e.get("spec_drafted"))
        e["prefix_cache_hit_rate"] = ratio(e.get("prefix_hits"), e.get("prefix_queries"))
        if tier in config.tiers:
            t = config.tiers[tier]
            e["efficiency"] = tier_efficiency(t, e)  # a CPU tier: against the measured limits
            e["levers"] = lever_summary(t)
    return engines


def build_manifest(
    config: TokenmillConfig, job_id: str, job, parts: list, partial: bool, staging: dict, sessions: list = ()
) -> Manifest:
    stored = {p.partition: PartitionCounts.parse(p.counts) for p in parts}
    committed = [c for p in parts if p.status == "succeeded" and (c := stored[p.partition]) is not None]
    t = PartitionCounts.model_validate(functools.reduce(_add, (c.as_json() for c in committed), {}))
    engines = engine_figures(config, {k: e.as_json() for k, e in t.engines.items()}, sessions)
    verification = summarise_verification([c.verification for c in committed], config.dedup.shadow_min_f1)
    return Manifest(
        job_id=job_id,
        status="incomplete" if partial else "succeeded",
        config_fingerprint=job.config_fingerprint,
        input_uri=redact_url(job.input_uri),  # a job staged before URIs with passwords were refused
        output_uri=redact_url(job.output_uri),
        template_version=config.prompt.template_version,
        largest_tier=config.largest_tier,  # the baseline tier
        created_at=aware(job.created_at).isoformat(),
        updated_at=now().isoformat(),
        counts=ManifestCounts(
            records=sum(p.records for p in parts),
            outputs=t.outputs,
            quarantined=t.quarantined,
            deferred_records=sum(p.records for p in parts if p.status == "deferred"),
            by_source=dict(sorted(t.by_source.items())),
            by_reason=dict(sorted(t.by_reason.items())),
            by_tier=dict(sorted(t.by_tier.items())),
        ),
        # with nothing committed, the three counts at 0 (as manifests have always had them)
        tokens=t.tokens if committed else Tokens(prompt_tokens=0, cached_prompt_tokens=0, output_tokens=0),
        prefix_cache=prefix_cache(t.tokens),
        routing=t.routing,
        unfaithful=Unfaithful(outputs=dict(sorted(t.unfaithful.outputs.items()))),
        checks={check: dict(sorted(t.checks.get(check, {}).items())) for check in CHECKS},
        acceptable=dict(sorted(t.acceptable.items())),
        judge=JudgeCounts(**{**t.judge.model_dump(), "verdicts": dict(sorted(t.judge.verdicts.items()))}),
        cost=ManifestCost(
            cost_usd=t.cost_usd,
            baseline_cost_usd=t.baseline_cost_usd,
            saved_usd=t.baseline_cost_usd - t.cost_usd,
            gpu_seconds=t.gpu_seconds,
            overhead_gpu_seconds=t.overhead_gpu_seconds,
            gpu_seconds_by_kind=dict(sorted(t.gpu_seconds_by_kind.items())),
        ),
        reuse=Reuse(
            by_source={
                src: ReusedBy(
                    items=n,
                    rate=round(n / t.outputs, 4) if t.outputs else 0.0,
                    saved_usd=t.saved_by_source.get(src, 0.0),
                )
                for src, n in sorted(t.by_source.items())
                if src != "generated"
            },
            saved_usd=sum(t.saved_by_source.values()),
            cache_status=dict(sorted(t.cache_status.items())),
            verification=verification,
        ),
        engines=engines,
        partitions={
            p.partition: PartitionEntry(
                file=p.file,
                records=p.records,
                status=p.status,
                attempts=p.attempts,
                seconds=stored[p.partition].seconds if stored[p.partition] else None,
            )
            for p in parts
        },
        **({"staging": staging} if staging else {}),
    )


def current_manifest(sources: ManifestSources, partial: bool) -> Manifest:
    """The manifest over what the catalog holds now (`partial` while any partition has not committed)."""
    job = sources.state.job(sources.job_id)
    staging = JobCounts.parse(job.counts).staging
    return build_manifest(
        sources.config,
        sources.job_id,
        job,
        sources.state.partitions(sources.job_id),
        partial,
        staging,
        sources.queue.sessions(sources.job_id),
    )


def refresh_manifest(sources: ManifestSources) -> Manifest:
    """Write and return the manifest over whatever has committed (partial while any partition has not).

    First publishes, in the tables, every partition the catalog committed whose commit a table lacks (its
    worker died between the catalog's commit and the tables' transactions), from the files the catalog
    recorded (output/tables.py: publishing is idempotent, and a newer claim's commit is never replaced). One
    the store refuses stays out of the tables, and the others are published: a StorageError then names it.
    """
    parts = sources.state.partitions(sources.job_id)
    committed = {
        p.partition: CommitRecord(id=p.commit_id, epoch=p.commit_epoch, files=p.commit_files or {})
        for p in parts
        if p.status == "succeeded" and p.commit_id is not None and p.commit_epoch is not None
    }
    published = published_epochs(sources.out, sources.job_id, committed) if committed else {}
    refused, gone = {}, []
    for partition, commit in committed.items():
        if published[partition] is None or published[partition] < commit.epoch:
            try:
                publish(sources.out, sources.job_id, partition, commit.epoch, commit.files)
            except StagedFileGone as e:  # no later publish can take it: its message names the partition's rerun
                gone.append(e)
            except Exception as e:  # the store refused it: the others are still published, this one next run
                refused[partition] = f"{type(e).__name__}: {e}".splitlines()[0]
    if gone:
        raise gone[0]
    if refused:
        first = next(iter(refused))
        raise storage.StorageError(
            f"committed partitions not in the output tables yet: {', '.join(list(refused)[:5])} ({first}: "
            f"{refused[first]}); "
            f"their files are staged and the job's next run publishes them: tokenmill rerun --job-id {sources.job_id}"
        )
    manifest = current_manifest(sources, partial=any(p.status != "succeeded" for p in parts))
    batch_files = sources.state.job(sources.job_id).batch_files
    if batch_files:  # the answers to batch files, in their own format, from the tables' snapshot
        partitions_of: dict[str, list[str]] = {}
        for p in parts:
            partitions_of.setdefault(p.file, []).append(p.partition)
        manifest.batches = write_batch_results(
            sources.config, sources.out, sources.job_id, batch_files, set(committed), partitions_of
        )
    write_manifest(sources.out, sources.job_id, manifest)
    return manifest
