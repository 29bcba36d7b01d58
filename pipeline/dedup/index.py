"""The near/semantic index of earlier jobs' generations: its segment format, how a partition's
segment is built, and how a scope's segments are loaded back for matching.

The cache store (pipeline/stores/cache.py) keeps segments as opaque blobs, one per (scope, recipe,
job/partition), replaced when a partition is re-run; this module owns what is inside them: item
keys and ids, MinHash signatures, embeddings (float16) and guard features of generated records.
"""

from __future__ import annotations

import io
import logging

import numpy as np
import pyarrow as pa
import xxhash

from pipeline.dedup import guards
from pipeline.keys import clean_text, compile_boilerplate
from pipeline.stores.cache import CacheStore

log = logging.getLogger(__name__)
SEGMENT_FIELDS = ("keys", "ids", "signatures", "embeddings", "features")


def pack_segment(
    keys: list[str], ids: list[str], signatures: np.ndarray, embeddings: np.ndarray | None, features: list[str]
) -> bytes:
    """One segment: item keys and ids, MinHash signatures, embeddings (float16, or none) and guard features."""
    buf = io.BytesIO()
    # Uncompressed: signatures and float16 embeddings are near-random bytes that zlib only spends time on.
    np.savez(
        buf,
        keys=np.array(keys, dtype=object).astype(str),
        ids=np.array(ids, dtype=object).astype(str),
        signatures=signatures.astype(np.uint32),
        embeddings=(embeddings if embeddings is not None else np.zeros((len(keys), 0))).astype(np.float16),
        features=np.array(features, dtype=object).astype(str),
    )
    data = buf.getvalue()
    return xxhash.xxh64_hexdigest(data).encode() + data  # checksum first: a torn or corrupt segment is detected


def unpack_segment(blob: bytes) -> dict[str, np.ndarray]:
    digest, data = blob[:16], blob[16:]
    if xxhash.xxh64_hexdigest(data).encode() != digest:
        raise ValueError("checksum mismatch")
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        return {f: z[f] for f in SEGMENT_FIELDS}


def load_index(store: CacheStore, scope: str, recipe: str) -> dict[str, np.ndarray] | None:
    """All segments of a (scope, recipe) concatenated; corrupt segments are skipped with a warning."""
    parts = []
    for name, blob in sorted(store.segments(scope, recipe).items()):
        try:
            parts.append(unpack_segment(blob))
        except Exception as e:
            log.warning(
                "cache index segment %s of scope %s is unreadable (%s: %s); skipped, its items are "
                "generated again if needed",
                name,
                scope,
                type(e).__name__,
                e,
            )
    parts = [p for p in parts if len(p["keys"])]
    if not parts:
        return None
    width = max(p["embeddings"].shape[1] for p in parts)
    return {
        "keys": np.concatenate([p["keys"] for p in parts]),
        "ids": np.concatenate([p["ids"] for p in parts]),
        "signatures": np.concatenate([p["signatures"] for p in parts]),
        # Segments written without embeddings (semantic off then) get zero vectors: they never match.
        "embeddings": np.concatenate(
            [
                p["embeddings"] if p["embeddings"].shape[1] == width else np.zeros((len(p["keys"]), width), np.float16)
                for p in parts
            ]
        ),
        "features": np.concatenate([p["features"] for p in parts]),
    }


def generated_segments(records: pa.Table, items: dict[str, dict], boilerplate_patterns: list[str]):
    """(scope, recipe, segment blob) for what a partition generated itself (not reused, not from the cache)."""
    boilerplate = compile_boilerplate(boilerplate_patterns)
    groups: dict[tuple[str, str], list[int]] = {}
    for row, (id_, key, scope, recipe) in enumerate(
        zip(*(records[c].to_pylist() for c in ("id", "item_key", "scope", "recipe")))
    ):
        item = items.get(key)
        if item is not None and item["id"] == id_ and item.get("origin") is None:
            groups.setdefault((scope, recipe), []).append(row)
    for (scope, recipe), rows in groups.items():
        part = records.take(pa.array(rows, pa.int64()))
        embeddings = None
        if pa.types.is_fixed_size_list(part["embedding"].type):
            embeddings = np.asarray(part["embedding"].combine_chunks().flatten(), np.float16).reshape(len(rows), -1)
        known = part["features"].to_pylist() if "features" in part.column_names else [None] * len(rows)
        signatures = np.asarray(part["signature"].combine_chunks().flatten(), np.uint32).reshape(len(rows), -1)
        blob = pack_segment(
            part["item_key"].to_pylist(),
            part["id"].to_pylist(),
            signatures,
            embeddings,
            [
                f or guards.features(clean_text(t, boilerplate)).to_json()
                for f, t in zip(known, part["text"].to_pylist())
            ],
        )
        yield scope, recipe, blob
