"""What each record of a partition gets: an output already paid for, a cached one, or a generation.

The dedup stage (at staging) said which output each record should reuse (`gen_key`). When a
partition runs, those keys are looked up: first among this job's paid items (state catalog), then
in the cache of earlier jobs (exact, by key). Anything still missing becomes a generation,
one per key. A record that was to reuse an earlier job's output that has since gone (expired,
evicted, the store down) falls back to generating its own: slower, never lost.

Shadow verification (shadow.py) checks the reuse decisions made here.
"""

from __future__ import annotations

import pyarrow as pa

from pipeline.schema import CACHED_FIELDS, GENERATION, GENERATION_FIELDS


def effective_keys(records: pa.Table) -> list[str]:
    """The item key whose output each record ends up with (shadow-verified records: their own)."""
    return [
        own if shadow else gen
        for own, gen, shadow in zip(
            records["item_key"].to_pylist(), records["gen_key"].to_pylist(), records["shadow"].to_pylist()
        )
    ]


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
    for name, values, typ in (
        ("gen_key", gen, pa.string()),
        ("reuse", reuse, pa.string()),
        ("similarity", sim, pa.float64()),
        ("shadow", shadow, pa.bool_()),
    ):
        records = records.set_column(records.schema.get_field_index(name), name, pa.array(values, typ))
    return records


def generations_for(records: pa.Table, missing: set[str]) -> pa.Table:
    """One row (id, text, tenant, scope, tier, item_key) per missing key: who generates it, from what text.

    A record with that key generates it; otherwise (the representative sits in another partition)
    the representative's id and text, carried by its members, do: the output is labelled by the
    record it summarises, whichever partition pays for it first.
    """
    rows: dict[str, dict] = {}
    names = (*GENERATION.names, "gen_key", "gen_id", "gen_text", "gen_tier")
    # (records staged before batch requests existed carry no `request`: all documents)
    cols = {c: records[c].to_pylist() if c in records.column_names else [None] * records.num_rows for c in names}
    for i in range(records.num_rows):
        key = cols["item_key"][i]
        if key in missing and key not in rows:
            rows[key] = {c: cols[c][i] for c in GENERATION.names}
    for i in range(records.num_rows):
        key = cols["gen_key"][i]
        if key in missing and key not in rows and cols["gen_id"][i] is not None:
            rows[key] = {
                "id": cols["gen_id"][i],
                "text": cols["gen_text"][i],
                "tenant": cols["tenant"][i],
                "scope": cols["scope"][i],
                "tier": cols["gen_tier"][i],
                "item_key": key,
                "request": cols["request"][i],  # the representative's template: a scope holds one
            }
    return pa.Table.from_pylist(list(rows.values()), schema=GENERATION)


def cached_items(hits: dict[str, dict], lookers: dict[str, dict], partition: str, created_at) -> dict[str, dict]:
    """State-catalog items for cache hits: free here, with their origin and what they cost there."""
    return {
        key: {
            **{f: value.get(f) for f in GENERATION_FIELDS},
            "id": lookers[key]["id"],
            "tenant": lookers[key]["tenant"],
            "partition": partition,
            "gpu_seconds": 0.0,
            "baseline_gpu_seconds": value["baseline_gpu_seconds"],
            "created_at": created_at,
            "origin": "cache",
            "source_job": value["job_id"],
            "source_id": value["id"],
            "saved_usd": value["cost_usd"],
            "cache_status": "hit",
            "chunks": value.get("chunks"),
            "unfaithful_terms": value.get("unfaithful_terms"),
            "adapter_digest": value.get("adapter_digest"),
            "compression_ratio": value.get("compression_ratio"),
            "copied_share": value.get("copied_share"),
            "topic_overlap": value.get("topic_overlap"),
        }
        for key, value in hits.items()
    }


def cache_value(item: dict, job_id: str, cost_usd: float) -> dict:
    """What the cache keeps of a generated item."""
    return {f: item.get(f) for f in CACHED_FIELDS} | {"job_id": job_id, "cost_usd": cost_usd}
