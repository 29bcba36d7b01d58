"""Arrow schemas of what flows between stages and what lands in Parquet, and the one item type.

Stages add columns as data flows one way: ingest (read, validate) -> dedup (content hashes) -> route
-> item keys -> dedup (clustering) at staging; then, per partition, generate (lookups, requests,
engine) -> output (rows, ledger, quarantine). pipeline/plan/stages.py declares each stage's columns.
"""

from __future__ import annotations

import json

import pyarrow as pa

# A batch request as ingest/batch.py parses it, once, when its line is read: what every later step reads
# (routing's model, dedup's scope, item keys, prompt rendering, sampling, the result lines), never its JSON.
# `messages` hold the document's slot as a null `content` at index `document` (null both for a completion
# request, whose prompt is the record's text); `params` are the sampling fields the request set (null: unset,
# the config's apply). `json_schema` is the JSON Schema a `response_format` asks for, as its JSON text: an
# arbitrary schema has no Arrow type, and only the sampling reads it (`request_params`).
MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
REQUEST_PARAMS = pa.struct(
    [
        ("max_tokens", pa.int64()),
        ("temperature", pa.float64()),
        ("top_p", pa.float64()),
        ("seed", pa.int64()),
        ("presence_penalty", pa.float64()),
        ("frequency_penalty", pa.float64()),
        ("repetition_penalty", pa.float64()),  # this and min_tokens: the judge's requests only (generate/judge.py)
        ("min_tokens", pa.int64()),
        ("stop", pa.list_(pa.string())),
        ("json_schema", pa.string()),
    ]
)
REQUEST = pa.struct(
    [
        ("format", pa.string()),  # "openai" or "anthropic"
        ("endpoint", pa.string()),
        ("model", pa.string()),
        ("messages", pa.list_(MESSAGE)),
        ("document", pa.int64()),
        ("params", REQUEST_PARAMS),
    ]
)


def request_params(request: dict) -> dict:
    """The sampling parameters a request (a REQUEST value, as Arrow gives it) sets, as SamplingConfig names
    them: the unset ones left out."""
    params = {k: v for k, v in (request.get("params") or {}).items() if v is not None}
    if "json_schema" in params:
        params["json_schema"] = json.loads(params["json_schema"])
    return params


# What the read stage emits: one row per record it saw, good or bad. `read_error` is set when the
# record could not be parsed at all; the validate stage turns those (and its own findings) into
# quarantine rows.
RAW_RECORDS = pa.schema(
    [
        ("id", pa.string()),
        ("text", pa.string()),
        ("tenant", pa.string()),
        ("metadata", pa.string()),  # JSON text of the record's metadata object, or null
        ("request", REQUEST),  # a batch request's messages, model and sampling (ingest/batch.py), or null
        ("file", pa.string()),  # path relative to the input root
        ("line", pa.int64()),  # 1-based line (JSONL) or row (Parquet); null for .txt/.md
        ("partition", pa.string()),
        ("read_error", pa.string()),  # reason code, or null
        ("read_detail", pa.string()),  # what the read stage found, for the quarantine row's `detail`
        ("raw_excerpt", pa.string()),  # raw input around a read error
    ]
)

# What the generate stage works from: one row per item key to generate, naming who generates it
# (`request`: a batch request's messages and sampling, ingest/batch.py; null for a document).
GENERATION = pa.schema(
    [*[(name, pa.string()) for name in ("id", "text", "tenant", "scope", "tier", "item_key")], ("request", REQUEST)]
)

# What one generation produced (the engine's completion of one request).
GENERATION_FIELDS = (
    "tier",
    "model",
    "summary",
    "prompt_tokens",
    "cached_prompt_tokens",
    "output_tokens",
    "finish_reason",
    "mean_logprob",
)

# The one item type: a paid-for (or reused) generation, by item key. The engine's completions carry
# its generation fields, the state catalog stores every field (pipeline/stores/catalog.py maps each
# to a column), the cache keeps CACHED_FIELDS of it, and the writer turns items into rows.
ITEM = pa.schema(
    [
        ("id", pa.string()),  # the record that generated it (the looker, for a cache hit)
        ("tenant", pa.string()),
        ("partition", pa.string()),
        ("tier", pa.string()),
        ("model", pa.string()),
        ("adapter_digest", pa.string()),  # content digest of the LoRA adapter it was made with (keys.adapter_digest)
        ("summary", pa.string()),
        ("prompt_tokens", pa.int64()),
        ("cached_prompt_tokens", pa.int64()),
        ("output_tokens", pa.int64()),
        ("finish_reason", pa.string()),
        ("gpu_seconds", pa.float64()),  # what it cost here: 0 for a cache hit
        ("baseline_gpu_seconds", pa.float64()),
        ("created_at", pa.timestamp("us", tz="UTC")),
        ("origin", pa.string()),  # "cache": reused from an earlier job; null: generated by this job
        ("source_job", pa.string()),
        ("source_id", pa.string()),
        ("saved_usd", pa.float64()),  # what the reused generation cost
        ("cache_status", pa.string()),  # hit | miss | bypassed | off
        ("mean_logprob", pa.float64()),  # the confidence signal
        ("chunks", pa.int64()),  # map-reduce: chunk summaries reduced
        ("unfaithful_terms", pa.int64()),  # numbers, dates and names the summary states that its document lacks
        ("compression_ratio", pa.float64()),  # zlib size / size of the summary: low for a loop (quality.py)
        ("copied_share", pa.float64()),  # share of its 6-word runs found verbatim in its document
        ("topic_overlap", pa.float64()),  # share of its topic words its document holds too: low when off topic
        ("session_id", pa.string()),  # the engine session that generated it (its start-up and idle share)
    ]
)
# What the cache keeps of a generated item (plus the job that paid and what it cost).
CACHED_FIELDS = (
    "id",
    *GENERATION_FIELDS,
    "adapter_digest",
    "baseline_gpu_seconds",
    "chunks",
    "unfaithful_terms",
    "compression_ratio",
    "copied_share",
    "topic_overlap",
)

OUTPUTS = pa.schema(
    [
        ("id", pa.string()),
        ("tenant", pa.string()),
        ("summary", pa.string()),
        ("tier", pa.string()),
        ("model", pa.string()),
        (
            "source",
            pa.string(),
        ),  # generated | duplicate_in_job | near_duplicate | semantic | cache_exact | cache_near | cache_semantic
        ("source_id", pa.string()),  # id of the item whose output was reused; null when generated
        ("similarity", pa.float64()),  # 1.0 for exact reuse, the score for near/semantic, null when generated
        ("prompt_tokens", pa.int64()),
        ("cached_prompt_tokens", pa.int64()),
        ("output_tokens", pa.int64()),
        ("finish_reason", pa.string()),
        ("template_version", pa.string()),
        ("job_id", pa.string()),
        ("created_at", pa.timestamp("us", tz="UTC")),
    ]
)

LEDGER = pa.schema(
    [
        ("job_id", pa.string()),
        ("partition", pa.string()),
        ("id", pa.string()),
        ("tenant", pa.string()),
        ("tier", pa.string()),
        ("model", pa.string()),
        ("adapter", pa.string()),  # the tenant's LoRA adapter folder the output was made with (null: the base model)
        ("adapter_digest", pa.string()),  # that adapter's content digest when the output was made: which training
        ("route_reason", pa.string()),  # why this tier: rule:<name> | router:<p> | default
        ("escalated", pa.bool_()),  # regenerated on the escalation tier after a low-confidence first attempt
        (
            "escalation_reason",
            pa.string(),
        ),  # why the first attempt was not kept: empty | degenerate | copied | off_topic | unfaithful | truncated |
        # low_logprob
        ("unfaithful", pa.bool_()),  # the served output states numbers, dates or names its document lacks (flagged)
        (
            "degenerate",
            pa.bool_(),
        ),  # the served output is a repetition loop (checks.degenerate_below); null: not measured
        ("copied", pa.bool_()),  # the served output gives its document back (checks.copied_above); null: not measured
        (
            "off_topic",
            pa.bool_(),
        ),  # the served output is about something else (checks.off_topic_below); null: not measured
        (
            "acceptable",
            pa.bool_(),
        ),  # served, and no check failed (degenerate, copied, off_topic, unfaithful, vague, truncated, judge)
        # The LLM judge's verdict (checks.judge) on an output that passed every other check: keep | bad | no_verdict
        # | unjudged (its request failed); null: not asked (no judge, or a check failed). Its cost: a `judge` row.
        ("judge", pa.string()),
        ("attempts", pa.int64()),  # generations paid for this row (1, +1 schema retry, +1 escalation; 0 when reused)
        ("chunks", pa.int64()),  # map-reduce: chunk summaries of a long document (0: not chunked)
        ("source", pa.string()),  # as in outputs
        ("source_id", pa.string()),
        ("source_job", pa.string()),  # job that generated a reused output (this job unless from the cache)
        ("similarity", pa.float64()),
        ("cache_status", pa.string()),  # generated items: miss | bypassed (store unreachable) | off; cache_*: hit
        ("prompt_tokens", pa.int64()),
        ("cached_prompt_tokens", pa.int64()),
        ("output_tokens", pa.int64()),
        ("gpu_seconds", pa.float64()),  # busy + overhead: every GPU-second the engines were held is in some row
        ("busy_gpu_seconds", pa.float64()),  # the engine steps that made this row's generations (token-weighted)
        ("overhead_gpu_seconds", pa.float64()),  # its share of its engines' start-up and idle time, pro rata to busy
        ("price_per_gpu_hour", pa.float64()),
        ("cost_usd", pa.float64()),
        ("baseline_cost_usd", pa.float64()),  # same item, no dedup and no cache, on the largest tier
        (
            "saved_cost_usd",
            pa.float64(),
        ),  # reused items: what the generation they reuse cost; generated: what the cache served of it
        ("quarantined", pa.bool_()),  # paid, but the output broke sampling.json_schema: no output row, a quarantine row
        (
            "kind",
            pa.string(),
        ),  # output | invalid_output (quarantined: schema or a check) | failed_attempt | lost | unfinished | judge
        ("created_at", pa.timestamp("us", tz="UTC")),
    ]
)

QUARANTINE = pa.schema(
    [
        ("id", pa.string()),
        ("tenant", pa.string()),
        ("file", pa.string()),
        ("line", pa.int64()),
        ("reason", pa.string()),
        ("detail", pa.string()),
        ("excerpt", pa.string()),
        ("job_id", pa.string()),
    ]
)

# Quarantine reason codes, with what they mean (docs/config.md lists them too).
REASONS = {
    "unreadable_file": "the file could not be opened or decoded as its format",
    "invalid_utf8": "the line or file is not valid UTF-8",
    "invalid_unicode": (
        "`id`, `text`, `tenant` or `metadata` holds a lone surrogate escape (e.g. `\\ud800`), which is not Unicode text"
    ),
    "malformed_json": "the line is not valid JSON",
    "number_too_long": "the line holds an integer longer than Python converts (4,300 digits)",
    "too_deeply_nested": "objects or arrays nested deeper than 100 levels",
    "not_an_object": "the JSON line is not an object",
    "unreadable_value": "a Parquet value could not be converted (e.g. a timestamp out of range)",
    "missing_id": "no `id` (or an empty one)",
    "invalid_id": "`id` is not a string or an integer, or contains a NUL character (the state catalog cannot store it)",
    "invalid_tenant": (
        "`tenant` is not a string or an integer, is longer than 200 characters, or contains "
        "a NUL character (the state catalog cannot store it)"
    ),
    "missing_text": "no `text` field, or null",
    "unsupported_request": "a batch request asks for what tokenmill does not do (the detail names it: tools, n > 1, "
    "images, another endpoint, an unknown field)",
    "invalid_request": "a batch request is not well formed (the detail names the field: no messages, no user "
    "message, a parameter out of range)",
    "unknown_model": "a batch request's `model` names no tier (tiers.<name>.served_model_names)",
    "non_string_text": "`text` is not a string",
    "empty_text": "`text` is empty or whitespace only",
    "too_large": "the document exceeds input.max_document_bytes",
    "duplicate_id": "the `id` appeared earlier in the job (the first occurrence wins)",
    "too_long": "the prompt does not fit the tier's context length",
    "engine_error": "the engine failed on this item even when run alone",
    "invalid_output": "the output broke sampling.json_schema, also after one retry (its cost is in the ledger)",
    "cancelled": "its job was cancelled (a cancelled batch) before this record was answered",
    "expired": "its job's time ran out (a batch's completion_window) before this record was answered",
    "budget_exceeded": "its job reached a budget cap (budget.*) before this record was answered; the answers it "
    "paid for are in the cache: submitted again under a higher cap, they cost nothing",
    **{
        check: f"the served output {what}, also after escalation, and checks.quarantine lists `{check}` "
        "(its cost is in the ledger)"
        for check, what in (
            ("degenerate", "is a repetition loop"),
            ("copied", "gives its document back"),
            ("off_topic", "is about something else than its document"),
        )
    },
}
