"""Output, write: give every valid record its output or quarantine row, and price it.

Under the output root, outputs/, ledger/ and quarantine/ are Delta Lake tables partitioned by job and
partition (tables.py says how a partition is committed), and jobs/<job>/manifest.json the job's manifest.
Every partition of the job is committed to all three tables (possibly with no rows); running a partition
again replaces its rows in one transaction instead of adding rows.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.config import TokenmillConfig
from pipeline.generate.quality import MEASURES, acceptable, flags
from pipeline.ingest.validate import quarantine_rows
from pipeline.keys import adapter_digest
from pipeline.output.manifest import Manifest
from pipeline.schema import LEDGER, OUTPUTS
from pipeline.stores import storage
from pipeline.stores.paths import OutputPath


def record_source(row: dict, item: dict) -> tuple[str, str | None, str | None, float | None]:
    """(source, source_id, source_job, similarity) of a record given the item whose output it gets."""
    from_cache = item.get("origin") == "cache"
    if item["id"] == row["id"] and not from_cache:
        return "generated", None, None, None
    kind = None if row["shadow"] else row["reuse"]  # a shadow-verified record gets its own key's output
    if kind is not None:  # near or semantic, in this job or from an earlier one
        if from_cache:
            return kind, item["source_id"], item["source_job"], row["similarity"]
        return kind, item["id"], None, row["similarity"]
    if from_cache:
        return "cache_exact", item["source_id"], item["source_job"], 1.0
    return "duplicate_in_job", item["id"], None, 1.0


def paid_price(config: TokenmillConfig, fresh: list[dict], served: dict, cost: float, gpu_seconds: float) -> float:
    """USD per GPU-hour of a row: the tier's of what this job paid for (an escalation the cache served is not
    paid here; nothing paid: the served output's tier); attempts on two tiers: the blended price, which keeps
    cost = GPU-seconds × price."""
    tiers = {p["tier"] for p in fresh}
    if len(tiers) > 1 and gpu_seconds > 0:
        return cost * 3600.0 / gpu_seconds
    tier = next(iter(tiers)) if tiers else served["tier"]
    return config.tiers[tier].price_per_gpu_hour if tier in config.tiers else 0.0


def check_flags(item: dict, config: TokenmillConfig, refused: bool, verdict: str | None = None) -> dict:
    """The ledger's output-check columns for the served item (null: recorded before the check existed), and
    `acceptable` (quality.acceptable: not empty, not truncated, no check failed) and not refused.

    `verdict`: the LLM judge's (followup.Outcome.verdict), its `judge` flag raised unless it is `keep`. No verdict,
    or none at all (the judge's request failed), is not `keep`: `acceptable` says a reader keeps the output, and
    once a deployment judges its outputs nothing else vouches for one; `calibrate --judge` counts it so too, so
    the agreement it reports is that of the rule applied here. The manifest counts each verdict apart."""
    every = flags(item, config.checks)
    if verdict is not None:
        every["judge"] = verdict != "keep"
    columns = {name: every[name] for name in (*MEASURES, "unfaithful")}
    judged = acceptable(every)
    columns["acceptable"] = None if judged is None else judged and not refused
    columns["judge"] = verdict
    return columns


def judge_charge(row: dict, outcome, overhead_ratio: Callable[[dict], float]) -> list[dict]:
    """The ledger charge (charge_rows) for the judge's verdict on a record's output, when this record asked for it
    and this job paid for it (a duplicate served the same output pays nothing; a verdict the cache held, nothing).
    Its own row (kind `judge`), so the output's row keeps what made the summary and the ledger what the judge cost."""
    judged = outcome.judge
    if judged is None or judged.get("origin") is not None or judged["id"] != row["id"]:
        return []
    return [
        {
            "partition": row["partition"],
            "id": row["id"],
            "tenant": row["tenant"],
            "tier": judged["tier"],
            "kind": "judge",
            "adapter": None,  # the judge runs on its tier's base model (worker.tenant_adapter)
            **{k: judged[k] for k in ("prompt_tokens", "cached_prompt_tokens", "output_tokens")},
            # its busy seconds, and its engine's start-up and idle share, as any generation carries
            "busy_gpu_seconds": judged["gpu_seconds"],
            "overhead_gpu_seconds": judged["gpu_seconds"] * overhead_ratio(judged),
        }
    ]


def record_costs(
    record_id: str, outcome, generated: bool, config: TokenmillConfig, overhead_ratio: Callable[[dict], float]
) -> tuple[list[dict], dict]:
    """What one record's ledger row pays and saves: (the paid items it is charged, its money and token fields).

    It pays what this job generated for it, if it is the generating record or one whose first attempt the
    cache served and whose retry or escalation ran here (never a copy of another record's output)."""
    item, paid = outcome.item, outcome.paid

    def usd(p: dict) -> float:
        held = p["gpu_seconds"] * (1 + overhead_ratio(p))
        return held * config.tiers[p["tier"]].price_per_gpu_hour / 3600.0 if p["tier"] in config.tiers else 0.0

    fresh = [p for p in paid if p.get("origin") is None]  # generated by this job
    charged = fresh if generated or any(p.get("id") == record_id for p in fresh) else []
    made_usd = sum(usd(p) for p in fresh) + sum(p["saved_usd"] or 0.0 for p in paid if p.get("origin") == "cache")
    busy = sum(p["gpu_seconds"] for p in charged)
    overhead = sum(p["gpu_seconds"] * overhead_ratio(p) for p in charged)
    cost = sum(usd(p) for p in charged)
    baseline = (item["baseline_gpu_seconds"] if outcome.escalated else sum(p["baseline_gpu_seconds"] for p in paid)) * (
        1 + overhead_ratio(paid[0])
    )
    return charged, {
        **{k: sum(p[k] for p in charged) for k in ("prompt_tokens", "cached_prompt_tokens", "output_tokens")},
        "attempts": outcome.attempts if charged else 0,
        "gpu_seconds": busy + overhead,
        "busy_gpu_seconds": busy,
        "overhead_gpu_seconds": overhead,
        "price_per_gpu_hour": paid_price(config, fresh, item, cost, busy + overhead),
        "cost_usd": cost,
        "baseline_cost_usd": baseline * config.tiers[config.largest_tier].price_per_gpu_hour / 3600.0,
        "saved_cost_usd": made_usd - cost,  # a generated row's: what the cache served of it (chunk summaries)
    }


def answer_tokens(item: dict, charged: list[dict]) -> dict[str, int]:
    """An output row's tokens: those of the attempt that produced it, as a client of the answer sees them (0 for
    a reused answer). The ledger row keeps what was paid: every attempt (draft, retry, escalation, chunks)."""
    fields = ("prompt_tokens", "cached_prompt_tokens", "output_tokens")
    return {k: (item[k] or 0) if charged else 0 for k in fields}


def assemble_results(
    records: pa.Table,
    items: dict[str, dict],
    failed: dict[str, tuple[str, str, str]],
    config: TokenmillConfig,
    job_id: str,
    created_at: datetime,
    overhead_ratio: Callable[[dict], float] = lambda item: 0.0,
) -> tuple[pa.Table, pa.Table, pa.Table]:
    """(outputs, ledger, quarantine) for a partition's valid, resolved `records`, each with a `partition` column.

    `items` maps an item key to its item (a dict of schema.ITEM's fields, as the state catalog holds it):
    generated by this job, or reused from the cache, with its chunks, retry and escalation (followup.py).
    The record that generated an item carries the cost of every call made for it; every other record
    getting that output costs nothing and records what it saved. `failed` maps an item key to (reason,
    detail, id of the record tried) when no output exists. Every record lands in exactly one of outputs
    and quarantine; the ledger has a row per output, plus one (`quarantined` true) per record quarantined
    as `invalid_output` after paid generations, so what a tenant paid is all in the ledger.
    `overhead_ratio(item)`: the start-up and idle GPU-seconds of its engine an item generated by this job
    carries per busy GPU-second; baselines carry it too (without dedup the engines would have started all
    the same).
    """
    from pipeline.generate.followup import final_output
    from pipeline.generate.reuse import effective_keys

    # Rows with an output; rows quarantined after paid generations (ledger only); the judge's charges (ledger only).
    served, paid_only, judged = [], [], []
    answered = []  # per served row, the tokens of the attempt that produced its output
    bad_rows, bad_reasons, bad_details = [], [], []
    rows = records.select(["id", "tenant", "partition", "reuse", "similarity", "shadow", "route_reason"]).to_pylist()
    for i, (row, key) in enumerate(zip(rows, effective_keys(records))):
        outcome = final_output(key, items, config)
        item, paid = outcome.item, outcome.paid
        refusal = outcome.refusal
        if item is None or refusal:
            reason, detail, tried = failed[key] if item is None else (*refusal, paid[0]["id"])
            bad_rows.append(i)  # KeyError above is a bug: a record with no fate
            bad_reasons.append(reason)
            bad_details.append(detail if tried == row["id"] else f"duplicate of {tried}: {detail}")
            if item is None:
                continue
        first = paid[0]
        # The source names what made the served output (an escalation or retry made here after a cache hit
        # is generated); what the record pays follows who made its first attempt.
        source, source_id, source_job, similarity = record_source(row, item)
        generated = source == "generated"
        first_here = record_source(row, first)[0] == "generated"
        charged, costs = record_costs(row["id"], outcome, first_here, config, overhead_ratio)
        if refusal and not charged:
            continue  # a copy of an invalid output: quarantined, paid nothing
        values = {
            "partition": row["partition"],
            "id": row["id"],
            "tenant": row["tenant"],
            "summary": item["summary"],
            "tier": item["tier"],
            "model": item["model"],
            "adapter": config.adapter(row["tenant"], item["tier"]),
            "adapter_digest": item.get("adapter_digest"),
            "source": source,
            "source_id": source_id,
            "similarity": similarity,
            "finish_reason": item["finish_reason"],
            "template_version": config.prompt.template_version,
            "job_id": job_id,
            "created_at": created_at,
            "route_reason": row["route_reason"],
            "escalated": outcome.escalated,
            "escalation_reason": outcome.escalation_reason,
            **check_flags(item, config, bool(refusal), outcome.verdict),
            "chunks": first.get("chunks") or 0,
            "source_job": source_job or (None if generated else job_id),
            "cache_status": item.get("cache_status") if generated or item.get("origin") == "cache" else None,
            "kind": "invalid_output" if refusal else "output",
            "quarantined": bool(refusal),
            **costs,
        }
        if refusal:
            paid_only.append(values)
        else:
            served.append(values)
            answered.append(answer_tokens(item, charged))
            judged.extend(judge_charge(row, outcome, overhead_ratio))

    answers = [values | tokens for values, tokens in zip(served, answered, strict=True)]
    outputs = pa.Table.from_pylist(answers, schema=pa.schema([("partition", pa.string()), *OUTPUTS]))
    ledger = pa.concat_tables(
        [pa.Table.from_pylist(served + paid_only, schema=LEDGER), charge_rows(judged, config, job_id, created_at)]
    )
    bad = records.take(pa.array(bad_rows, pa.int64()))
    quarantine = quarantine_rows(
        bad,
        pa.array(bad_reasons, pa.string()),
        job_id,
        config.input.excerpt_chars,
        detail=pa.array(bad_details, pa.string()),
    )
    return outputs, ledger, quarantine


def charge_rows(charges: list[dict], config: TokenmillConfig, job_id: str, created_at: datetime) -> pa.Table:
    """Ledger rows for GPU time no output carries (`kind` failed_attempt, lost, unfinished or judge): charges with
    their `busy_gpu_seconds` and `overhead_gpu_seconds` already split (and tokens, and `adapter`, where known)."""
    rows = []
    for ch in charges:
        tier = config.tiers.get(ch["tier"])
        price = tier.price_per_gpu_hour if tier else 0.0
        gpu = ch["busy_gpu_seconds"] + ch["overhead_gpu_seconds"]
        adapter = ch["adapter"] if "adapter" in ch else config.adapter(ch.get("tenant"), ch["tier"])
        rows.append(
            {
                "job_id": job_id,
                "partition": ch["partition"],
                "id": ch.get("id"),
                "tenant": ch.get("tenant"),
                "tier": ch["tier"],
                "model": tier.generator if tier else None,
                "kind": ch["kind"],
                "adapter": adapter,
                "adapter_digest": adapter_digest(adapter),
                "escalated": False,
                "attempts": 1 if ch["kind"] == "failed_attempt" else 0,
                "chunks": 0,
                **{k: ch.get(k, 0) for k in ("prompt_tokens", "cached_prompt_tokens", "output_tokens")},
                "gpu_seconds": gpu,
                "busy_gpu_seconds": ch["busy_gpu_seconds"],
                "overhead_gpu_seconds": ch["overhead_gpu_seconds"],
                "price_per_gpu_hour": price,
                "cost_usd": gpu * price / 3600.0,
                "baseline_cost_usd": 0.0,
                "saved_cost_usd": 0.0,
                "quarantined": False,
                "created_at": created_at,
            }
        )
    return pa.Table.from_pylist(rows, schema=LEDGER)


def write_manifest(root: storage.Location, job_id: str, manifest: Manifest) -> None:
    data = json.dumps(manifest.as_json(), indent=2, sort_keys=False, default=str).encode()
    storage.write_bytes_atomic(root, OutputPath.manifest(job_id).full(root), data)


def count_by(table: pa.Table, column: str) -> dict[str, int]:
    if table.num_rows == 0:
        return {}
    counts = pc.value_counts(table[column]).to_pylist()
    return {c["values"]: c["counts"] for c in sorted(counts, key=lambda c: str(c["values"]))}
