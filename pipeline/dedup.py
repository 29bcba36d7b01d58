"""Stage 3, dedup: generate once per distinct document within a job; the copies reuse its output.

Two records are exact duplicates when they belong to the same tenant and their normalised texts
are equal (Unicode NFC, whitespace collapsed, optionally case-folded). The first record of each
group is its representative; the others get `duplicate_of` = the representative's id and cost
nothing. Tenants never share outputs.

Across partitions and reruns, the same grouping runs on the request's content key (`item_key`:
content hash + model + prompt + sampling), looked up in the state catalog's paid-for items.
"""

from __future__ import annotations

import re
import unicodedata

import pyarrow as pa
import xxhash

from pipeline.config import DedupConfig

_WHITESPACE = re.compile(r"\s+")


def normalise_text(text: str, case_fold: bool = False) -> str:
    text = _WHITESPACE.sub(" ", unicodedata.normalize("NFC", text)).strip()
    return text.casefold() if case_fold else text


def content_hash(tenant: str, text: str, case_fold: bool = False) -> str:
    """128-bit xxh3 of (tenant, normalised text): fast, and collisions are negligible at corpus scale."""
    return xxhash.xxh3_128_hexdigest(f"{tenant}\x00{normalise_text(text, case_fold)}".encode())


def add_content_hashes(records: pa.Table, config: DedupConfig) -> pa.Table:
    """Add `content_hash`: equal for exact duplicates; the record's own id joins it when dedup is off."""
    hashes = [content_hash(t, x if config.exact else f"{i}\x00{x}", config.case_fold)
              for i, t, x in zip(records["id"].to_pylist(), records["tenant"].to_pylist(), records["text"].to_pylist())]
    return records.append_column("content_hash", pa.array(hashes, pa.string()))


def mark_duplicates(records: pa.Table, key: str) -> pa.Table:
    """Add `duplicate_of`: the id of the first record with the same `key`, null for that first record."""
    duplicate_of: list[str | None] = []
    first: dict[str, str] = {}
    for id_, k in zip(records["id"].to_pylist(), records[key].to_pylist()):
        duplicate_of.append(first.get(k))
        first.setdefault(k, id_)
    return records.append_column("duplicate_of", pa.array(duplicate_of, pa.string()))
