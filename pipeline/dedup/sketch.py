"""Dedup sketches: what clustering compares instead of texts, computed per record.

  signature   MinHash over word shingles (minhash.py), for near duplicates and the cache index
  embedding   a static embedding (embed.py), float16, for semantic neighbours

Per record, so a job sketches its input file by file (in parallel, pipeline/plan/streamed.py) and
clustering keeps only these columns in memory, never the texts.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import numpy as np
import pyarrow as pa

from pipeline.config import DedupConfig
from pipeline.dedup import minhash
from pipeline.keys import clean_text, compile_boilerplate


class Embedder(Protocol):
    def encode(self, texts: list[str]) -> np.ndarray: ...  # (n, d) float32, rows L2-normalised


def sketch_records(
    records: pa.Table, config: DedupConfig, embedder: Embedder | None = None, with_cache: bool = False
) -> pa.Table:
    """Add every record's `signature` (MinHash, when near dedup or the cache index needs it; zeros
    otherwise) and `embedding` (float16, with an embedder; null otherwise).

    Every row, not only the first of each key: which copy comes
    first is only known once ids repeated across files are quarantined."""
    n = records.num_rows
    boilerplate = compile_boilerplate(config.boilerplate_patterns)
    texts = [clean_text(t, boilerplate) for t in records["text"].to_pylist()]
    embedding = _embed_in_background(embedder, texts) if embedder is not None else None  # (0, d) for none: the width
    sigs = np.zeros((n, config.num_perm), np.uint32)
    if (config.near or with_cache) and n:
        sigs = minhash.signatures(
            [t.casefold() for t in texts] if config.case_fold else texts, config.shingle_words, config.num_perm
        )
    out = records.append_column(
        "signature", pa.FixedSizeListArray.from_arrays(pa.array(sigs.reshape(-1), pa.uint32()), config.num_perm)
    )
    if embedding is None:
        return out.append_column("embedding", pa.nulls(n, pa.list_(pa.float16())))
    vectors = embedding.result().astype(np.float16)
    return out.append_column(
        "embedding", pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1), pa.float16()), vectors.shape[1])
    )


def signature_matrix(records: pa.Table, num_perm: int) -> np.ndarray:
    """The `signature` column as uint32[n, num_perm] (no copy when it has one chunk)."""
    column = records["signature"].combine_chunks()
    return np.asarray(column.flatten(), np.uint32).reshape(len(column), num_perm)


def embedding_matrix(records: pa.Table) -> np.ndarray | None:
    """The `embedding` column as float16[n, d], or None when the records have no embeddings."""
    column = records["embedding"].combine_chunks()
    if not pa.types.is_fixed_size_list(column.type) or not column.type.list_size:
        return None
    return np.asarray(column.flatten(), np.float16).reshape(len(column), column.type.list_size)


def _embed_in_background(embedder: Embedder, texts: list[str]):
    """A future of `texts`' embeddings.

    Embedding (the Rust tokenizer, numpy and scipy: mostly outside the GIL) runs on a second thread
    while the caller computes MinHash signatures, so the two overlap on two cores.
    """
    worker = ThreadPoolExecutor(1, thread_name_prefix="embed")
    embedding = worker.submit(embedder.encode, texts)
    worker.shutdown(wait=False)
    return embedding
