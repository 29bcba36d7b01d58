"""Arrow schemas of what flows between stages and what lands in Parquet.

Stages add columns as data flows one way: read -> validate -> dedup -> route -> plan -> infer -> write.
"""

from __future__ import annotations

import pyarrow as pa

# What the read stage emits: one row per record it saw, good or bad. `read_error` is set when the
# record could not be parsed at all; the validate stage turns those (and its own findings) into
# quarantine rows.
RAW_RECORDS = pa.schema([
    ("id", pa.string()),
    ("text", pa.string()),
    ("tenant", pa.string()),
    ("metadata", pa.string()),      # JSON text of the record's metadata object, or null
    ("file", pa.string()),          # path relative to the input root
    ("line", pa.int64()),           # 1-based line (JSONL) or row (Parquet); null for .txt/.md
    ("partition", pa.string()),
    ("read_error", pa.string()),    # reason code, or null
    ("raw_excerpt", pa.string()),   # raw input around a read error
])

OUTPUTS = pa.schema([
    ("id", pa.string()),
    ("tenant", pa.string()),
    ("summary", pa.string()),
    ("tier", pa.string()),
    ("model", pa.string()),
    ("source", pa.string()),        # generated | duplicate_in_job | near_duplicate | semantic | cache_exact | cache_near | cache_semantic
    ("source_id", pa.string()),     # id of the item whose output was reused; null when generated
    ("similarity", pa.float64()),   # 1.0 for exact reuse, the score for near/semantic, null when generated
    ("prompt_tokens", pa.int64()),
    ("cached_prompt_tokens", pa.int64()),
    ("output_tokens", pa.int64()),
    ("finish_reason", pa.string()),
    ("template_version", pa.string()),
    ("job_id", pa.string()),
    ("created_at", pa.timestamp("us", tz="UTC")),
])

LEDGER = pa.schema([
    ("job_id", pa.string()),
    ("partition", pa.string()),
    ("id", pa.string()),
    ("tenant", pa.string()),
    ("tier", pa.string()),
    ("model", pa.string()),
    ("route_reason", pa.string()),  # why this tier: rule:<name> | router:<p> | default
    ("escalated", pa.bool_()),      # regenerated on the escalation tier after a low-confidence first attempt
    ("attempts", pa.int64()),       # generations paid for this row (1, +1 schema retry, +1 escalation; 0 when reused)
    ("chunks", pa.int64()),         # map-reduce: chunk summaries of a long document (0: not chunked)
    ("source", pa.string()),        # as in outputs
    ("source_id", pa.string()),
    ("source_job", pa.string()),    # job that generated a reused output (this job unless from the cache)
    ("similarity", pa.float64()),
    ("cache_status", pa.string()),  # generated items: miss | bypassed (store unreachable) | off; cache_*: hit
    ("prompt_tokens", pa.int64()),
    ("cached_prompt_tokens", pa.int64()),
    ("output_tokens", pa.int64()),
    ("gpu_seconds", pa.float64()),
    ("price_per_gpu_hour", pa.float64()),
    ("cost_usd", pa.float64()),
    ("baseline_cost_usd", pa.float64()),  # same item, no dedup and no cache, on the largest tier
    ("saved_cost_usd", pa.float64()),     # reused items: what the generation they reuse cost; else 0
    ("quarantined", pa.bool_()),    # paid, but the output broke sampling.json_schema: no output row, a quarantine row
    ("created_at", pa.timestamp("us", tz="UTC")),
])

QUARANTINE = pa.schema([
    ("id", pa.string()),
    ("tenant", pa.string()),
    ("file", pa.string()),
    ("line", pa.int64()),
    ("reason", pa.string()),
    ("detail", pa.string()),
    ("excerpt", pa.string()),
    ("job_id", pa.string()),
])

# Quarantine reason codes, with what they mean (docs/config.md lists them too).
REASONS = {
    "unreadable_file": "the file could not be opened or decoded as its format",
    "invalid_utf8": "the line or file is not valid UTF-8",
    "malformed_json": "the line is not valid JSON",
    "not_an_object": "the JSON line is not an object",
    "missing_id": "no `id` (or an empty one)",
    "invalid_id": "`id` is not a string or an integer",
    "missing_text": "no `text` field, or null",
    "non_string_text": "`text` is not a string",
    "empty_text": "`text` is empty or whitespace only",
    "too_large": "the document exceeds input.max_document_bytes",
    "duplicate_id": "the `id` appeared earlier in the job (the first occurrence wins)",
    "too_long": "the prompt does not fit the tier's context length",
    "engine_error": "the engine failed on this item even when run alone",
    "invalid_output": "the output broke sampling.json_schema, also after one retry (its cost is in the ledger)",
}
