"""What each record of a partition gets: an output already paid for, a cached one, or a generation.

The dedup stage (at planning) said which output each record should reuse (`gen_key`). When a
partition runs, those keys are looked up: first among this job's paid items (state catalog), then
in the cache of earlier jobs (exact, by key). Anything still missing becomes a generation unit,
one per key. A record that was to reuse an earlier job's output that has since gone (expired,
evicted, the store down) falls back to generating its own: slower, never lost.

Shadow verification lives here too: a sampled reused record is generated anyway and its output
compared with the one it would have reused; the share that disagree is the measured false-hit rate.
"""

from __future__ import annotations

import math
import re
from collections import Counter

import pyarrow as pa

CACHE_KINDS = ("cache_near", "cache_semantic")
ITEM_COLUMNS = ("id", "text", "tenant", "scope", "tier", "item_key")


def effective_keys(records: pa.Table) -> list[str]:
    """The item key whose output each record ends up with (shadow-verified records: their own)."""
    return [own if shadow else gen for own, gen, shadow in
            zip(records["item_key"].to_pylist(), records["gen_key"].to_pylist(), records["shadow"].to_pylist())]


def reference_keys(records: pa.Table) -> list[str]:
    """Keys shadow-verified records are compared against (what they would have reused)."""
    return [gen for gen, shadow in zip(records["gen_key"].to_pylist(), records["shadow"].to_pylist()) if shadow]


def needed_keys(records: pa.Table) -> list[str]:
    return sorted(set(effective_keys(records)) | set(reference_keys(records)))


def resolve(records: pa.Table, available: set[str]) -> pa.Table:
    """Records whose reuse target from an earlier job is not available fall back to their own generation."""
    own, gen = records["item_key"].to_pylist(), records["gen_key"].to_pylist()
    gen_id, reuse, sim = records["gen_id"].to_pylist(), records["reuse"].to_pylist(), records["similarity"].to_pylist()
    shadow = records["shadow"].to_pylist()
    changed = False
    for i in range(records.num_rows):
        if gen[i] != own[i] and gen_id[i] is None and gen[i] not in available:  # only cache targets lack a gen_id
            gen[i], reuse[i], sim[i], shadow[i] = own[i], None, None, False
            changed = True
    if not changed:
        return records
    for name, values, typ in (("gen_key", gen, pa.string()), ("reuse", reuse, pa.string()),
                              ("similarity", sim, pa.float64()), ("shadow", shadow, pa.bool_())):
        records = records.set_column(records.schema.get_field_index(name), name, pa.array(values, typ))
    return records


def generation_units(records: pa.Table, missing: set[str]) -> pa.Table:
    """One row (id, text, tenant, scope, tier, item_key) per missing key: who generates it, from what text.

    A record with that key generates it; otherwise (the representative sits in another partition)
    the representative's id and text, carried by its members, do: the output is labelled by the
    record it summarises, whichever partition pays for it first.
    """
    rows: dict[str, dict] = {}
    cols = {c: records[c].to_pylist() for c in (*ITEM_COLUMNS, "gen_key", "gen_id", "gen_text", "gen_tier")}
    for i in range(records.num_rows):
        key = cols["item_key"][i]
        if key in missing and key not in rows:
            rows[key] = {c: cols[c][i] for c in ITEM_COLUMNS}
    for i in range(records.num_rows):
        key = cols["gen_key"][i]
        if key in missing and key not in rows and cols["gen_id"][i] is not None:
            rows[key] = {"id": cols["gen_id"][i], "text": cols["gen_text"][i], "tenant": cols["tenant"][i],
                         "scope": cols["scope"][i], "tier": cols["gen_tier"][i], "item_key": key}
    units = list(rows.values())
    return pa.table({c: [u[c] for u in units] for c in ITEM_COLUMNS},
                    schema=pa.schema([(c, pa.string()) for c in ITEM_COLUMNS]))


def cached_items(hits: dict[str, dict], lookers: dict[str, dict], partition: str, created_at) -> dict[str, dict]:
    """State-catalog items for cache hits: free here, with their origin and what they cost there."""
    return {key: {
        "id": lookers[key]["id"], "tenant": lookers[key]["tenant"], "partition": partition,
        "tier": value["tier"], "model": value["model"], "summary": value["summary"],
        "prompt_tokens": value["prompt_tokens"], "cached_prompt_tokens": value["cached_prompt_tokens"],
        "output_tokens": value["output_tokens"], "finish_reason": value["finish_reason"],
        "gpu_seconds": 0.0, "baseline_gpu_seconds": value["baseline_gpu_seconds"], "created_at": created_at,
        "origin": "cache", "source_job": value["job_id"], "source_id": value["id"], "saved_usd": value["cost_usd"],
        "cache_status": "hit", "mean_logprob": value.get("mean_logprob"), "chunks": value.get("chunks"),
    } for key, value in hits.items()}


def cache_value(item: dict, job_id: str, cost_usd: float) -> dict:
    """What the cache keeps of a generated item."""
    return {f: item.get(f) for f in ("tier", "model", "summary", "prompt_tokens", "cached_prompt_tokens", "output_tokens",
                                     "finish_reason", "id", "baseline_gpu_seconds", "mean_logprob", "chunks")} | {
        "job_id": job_id, "cost_usd": cost_usd}


# -- shadow verification --------------------------------------------------------------------------------
_TOKEN = re.compile(r"\w+")


def token_f1(a: str, b: str) -> float:
    """Token-level F1 of two outputs (SQuAD style, lowercased word tokens); 1.0 when both are empty."""
    ta, tb = _TOKEN.findall(a.lower()), _TOKEN.findall(b.lower())
    if not ta and not tb:
        return 1.0
    common = sum((Counter(ta) & Counter(tb)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(ta), common / len(tb)
    return 2 * precision * recall / (precision + recall)


def wilson_interval(failures: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion: sound at small n and at 0 observed failures."""
    if n == 0:
        return (0.0, 1.0)
    p = failures / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def verify_shadows(records: pa.Table, items: dict[str, dict], reference: dict[str, str], min_f1: float) -> dict:
    """Compare each shadow-verified record's own output with the one it would have reused.

    `reference` maps a key to its output text (this job's items, or the cache for earlier jobs).
    Returns counts per reuse kind and the ids of disagreements (a few, for inspection).
    """
    by_kind: dict[str, dict] = {}
    samples = []
    for id_, own, gen, kind, sim, shadow in zip(*(records[c].to_pylist() for c in
                                                  ("id", "item_key", "gen_key", "reuse", "similarity", "shadow"))):
        if not shadow or own not in items or gen not in reference:
            continue
        f1 = token_f1(reference[gen], items[own]["summary"])
        k = by_kind.setdefault(kind, {"checked": 0, "false_hits": 0})
        k["checked"] += 1
        if f1 < min_f1:
            k["false_hits"] += 1
            if len(samples) < 20:
                samples.append({"id": id_, "kind": kind, "similarity": round(sim or 0.0, 4), "f1": round(f1, 4)})
    return {"by_kind": by_kind, "false_hit_samples": samples}


def summarise_verification(parts: list[dict], min_f1: float) -> dict:
    """Partition results summed, with the false-hit rate and its 95% interval, overall and per kind."""
    by_kind: dict[str, dict] = {}
    samples: list[dict] = []
    for part in parts:
        for kind, v in part.get("by_kind", {}).items():
            k = by_kind.setdefault(kind, {"checked": 0, "false_hits": 0})
            k["checked"] += v["checked"]
            k["false_hits"] += v["false_hits"]
        samples.extend(part.get("false_hit_samples", []))

    def rate(v: dict) -> dict:
        low, high = wilson_interval(v["false_hits"], v["checked"])
        return {**v, "false_hit_rate": round(v["false_hits"] / v["checked"], 4) if v["checked"] else None,
                "ci95": [round(low, 4), round(high, 4)]}

    total = {"checked": sum(v["checked"] for v in by_kind.values()),
             "false_hits": sum(v["false_hits"] for v in by_kind.values())}
    return {**rate(total), "min_f1": min_f1, "by_kind": {k: rate(v) for k, v in sorted(by_kind.items())},
            "false_hit_samples": samples[:20]}
