"""Ingest, validate: split raw records into valid records and quarantine rows with a reason.

Every raw record leaves this stage exactly once: as a valid record or as a quarantine row.
Checks run in a fixed order and the first failing one names the reason. Duplicate ids are
checked last among valid records, so the first *valid* occurrence of an id wins.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.config import InputConfig
from pipeline.schema import QUARANTINE

# What the state catalog can store (pipeline/stores/catalog.py): items.tenant is String(200), and
# PostgreSQL text refuses the NUL character in items.id and items.tenant. A record the catalog would
# refuse is quarantined here, before anyone pays to generate it. (The text never reaches the catalog.)
TENANT_MAX_CHARS = 200


def quarantine_rows(
    records: pa.Table, reasons: pa.Array, job_id: str, excerpt_chars: int, detail: pa.Array | None = None
) -> pa.Table:
    """Quarantine rows (QUARANTINE plus `partition`) for `records`, one per row of `reasons`.

    The excerpt is the raw input where the read stage kept one, else the start of the text."""
    if "raw_excerpt" in records.column_names:
        excerpt = pc.coalesce(records["raw_excerpt"], pc.utf8_slice_codeunits(records["text"], 0, excerpt_chars))
    else:
        excerpt = pc.utf8_slice_codeunits(records["text"], 0, excerpt_chars)
    n = records.num_rows
    return pa.table(
        {
            "partition": records["partition"],
            "id": records["id"],
            "tenant": records["tenant"],
            "file": records["file"],
            "line": records["line"],
            "reason": reasons,
            "detail": detail if detail is not None else pa.nulls(n, pa.string()),
            "excerpt": excerpt,
            "job_id": pa.array([job_id] * n, pa.string()),
        },
        schema=pa.schema([("partition", pa.string()), *QUARANTINE]),
    )


def requested_models(raw: pa.Table) -> list[str | None]:
    """Per row, the model a batch request asks for (None: a document record)."""
    return pc.struct_field(raw["request"], "model").to_pylist()


def validate_records(
    raw: pa.Table, config: InputConfig, job_id: str, duplicate_ids: bool = True, models: dict | None = None
) -> tuple[pa.Table, pa.Table]:
    """(valid records, quarantine rows).

    Valid records keep every RAW_RECORDS column except the read-error ones (read_error, read_detail,
    raw_excerpt). `duplicate_ids` False: repeated ids are left for the caller (the planner checks
    them across files, in job order: `duplicate_rows`). `models`: the model names batch requests may ask
    for (None: any; routing decides the tier).
    """
    n = raw.num_rows
    text_bytes = pc.binary_length(raw["text"].cast(pa.binary()))
    no_catalog = "the state catalog cannot store it"
    checks = [  # (reason, failed, detail)
        ("read_error", pc.is_valid(raw["read_error"]), raw["read_detail"]),
        ("missing_id", pc.is_null(raw["id"]), None),
        ("invalid_id", pc.match_substring(raw["id"], "\x00"), f"`id` contains a NUL character; {no_catalog}"),
        (
            "invalid_tenant",
            pc.greater(pc.utf8_length(raw["tenant"]), TENANT_MAX_CHARS),
            f"`tenant` is longer than {TENANT_MAX_CHARS} characters; {no_catalog}",
        ),
        (
            "invalid_tenant",
            pc.match_substring(raw["tenant"], "\x00"),
            f"`tenant` contains a NUL character; {no_catalog}",
        ),
        ("missing_text", pc.is_null(raw["text"]), None),
        ("empty_text", pc.equal(pc.utf8_trim_whitespace(raw["text"]), ""), None),
        ("too_large", pc.greater(text_bytes, config.max_document_bytes), None),
    ]
    if models is not None and raw["request"].null_count < n:
        asked = requested_models(raw)
        # The names a tenant may use, never a tier's `model` path (a tier answers to it, but it names a folder).
        names = ", ".join(sorted({m for m, tier in models.items() if m == tier or "/" not in m}))
        unknown = [m is not None and m not in models for m in asked]
        why = [f"`model` {m!r} is served by no tier (served: {names})" if u else None for m, u in zip(asked, unknown)]
        checks.append(("unknown_model", pa.array(unknown), pa.array(why, pa.string())))
    reason, detail = pa.nulls(n, pa.string()), pa.nulls(n, pa.string())
    for code, failed, why in checks:
        first = pc.and_(pc.is_null(reason), pc.fill_null(failed, False))
        value = raw["read_error"] if code == "read_error" else pa.scalar(code)
        reason = pc.if_else(first, value, reason)
        if why is not None:
            detail = pc.if_else(first, why if not isinstance(why, str) else pa.scalar(why), detail)

    # Duplicate ids among the records that passed so far: the first occurrence wins.
    passed = pc.is_null(reason).combine_chunks() if isinstance(reason, pa.ChunkedArray) else pc.is_null(reason)
    ids = raw["id"].combine_chunks()
    if duplicate_ids:
        passed_at = [i for i, ok in enumerate(passed.to_pylist()) if ok]
        dup = [False] * n
        for j in duplicate_rows(ids.filter(passed), set()):
            dup[passed_at[j]] = True
        reason = pc.if_else(pa.array(dup), pa.scalar("duplicate_id"), reason)

    bad = pc.is_valid(reason)
    bad_records = raw.filter(bad)
    quarantine = quarantine_rows(bad_records, reason.filter(bad), job_id, config.excerpt_chars, detail.filter(bad))
    valid = raw.filter(pc.invert(bad)).drop_columns(["read_error", "read_detail", "raw_excerpt"])
    return valid, quarantine


def duplicate_rows(ids: pa.Array, seen: set[str]) -> list[int]:
    """Positions in `ids` of ids already in `seen` (from earlier files) or earlier in `ids`; adds the rest
    to `seen`. The first valid occurrence of an id wins."""
    dups = []
    for i, id_ in enumerate(ids.to_pylist()):
        if id_ in seen:
            dups.append(i)
        else:
            seen.add(id_)
    return dups
