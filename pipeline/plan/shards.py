"""Planning's cluster step: a job's dedup scopes in shards, each clustered in a process of its own.

  cut_scopes      a scope larger than `planning.shard_rows` records is cut into parts (dedup/split.py)
  cluster_shard   one shard's scopes (whole scopes, or parts of cut ones): near, semantic and cache reuse
                  over the shard's compact columns (keys, signatures, embeddings), texts read back from
                  the staging area only for the pairs the guards compare

Called by plan.py, which runs the steps around it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash

from pipeline.config import TokenmillConfig
from pipeline.dedup import minhash, split
from pipeline.dedup.cluster import DedupStats
from pipeline.dedup.sketch import embedding_matrix, signature_matrix
from pipeline.plan.stages import StageContext, run_stages, stage_named

log = logging.getLogger(__name__)
ROW = "_row"  # a keyed record's position in its partition
# What a shard of the cluster step reads of each keyed partition (its `sketch` file): never the text.
SHARD_COLUMNS = ("id", "tenant", "partition", "tier", "scope", "recipe", "item_key", "signature", "embedding", ROW)
TEXT_CACHE_BYTES = 256 << 20  # partition texts a shard keeps for the guards (LRU)
# A shard's reuse decisions for one partition (`reuse-<shard>`), joined to its keyed records by ROW.
DECISIONS = pa.schema(
    [
        (ROW, pa.int32()),
        ("gen_key", pa.string()),
        ("gen_id", pa.string()),
        ("gen_tier", pa.string()),
        ("reuse", pa.string()),
        ("similarity", pa.float64()),
        ("shadow", pa.bool_()),
        ("features", pa.string()),
        ("gen_partition", pa.string()),
        ("gen_row", pa.int32()),
    ]
)


def cut_scopes(config: TokenmillConfig, staging, partitions: list[str], big: dict[str, int]) -> dict[str, list[int]]:
    """Cut each scope of `big` (scope -> rows) into parts of about `planning.shard_rows` records, whole
    components of its LSH buckets (split.py; of its item keys when near dedup is off), and stage each
    partition's part per keyed row (`split`, -1 outside a cut scope). Rows per part, by scope."""
    d = config.dedup
    bands, rows_per_band = minhash.bands_for(d.near_threshold, d.num_perm)
    where: dict[str, list[tuple[int, np.ndarray]]] = {scope: [] for scope in big}  # (partition, its rows)
    hashes: dict[str, list[np.ndarray]] = {scope: [] for scope in big}
    positions: dict[str, list[np.ndarray]] = {scope: [] for scope in big}
    sizes = []
    for i, partition in enumerate(partitions):
        sketch = staging.sketch(partition, columns=["scope", "item_key", "signature", "embedding"])
        sizes.append(sketch.num_rows)
        scopes = np.asarray(sketch["scope"].to_pylist(), object)
        for scope in big:
            rows = np.flatnonzero(scopes == scope)
            if not len(rows):
                continue
            mine = sketch.take(rows)
            where[scope].append((i, rows))
            vectors = embedding_matrix(mine)
            if vectors is not None:
                positions[scope].append(split.semantic_positions(vectors))
            hashes[scope].append(
                minhash.band_hashes(signature_matrix(mine, d.num_perm), bands, rows_per_band)
                if d.near
                else np.array([[xxhash.xxh3_64_intdigest(k.encode())] for k in mine["item_key"].to_pylist()], np.uint64)
            )
    labels = [np.full(n, -1, np.int32) for n in sizes]
    cut = {}
    for scope, n in big.items():
        band, count = np.concatenate(hashes.pop(scope)), -(-n // config.planning.shard_rows)
        position = np.concatenate(positions.pop(scope)) if positions[scope] else None
        if position is not None and len(position) != len(band):  # some partitions without embeddings
            position = None
        part_of_row = split.parts(split.components(band), count, position)
        cut[scope] = np.bincount(part_of_row, minlength=count).tolist()
        at = 0
        for i, rows in where.pop(scope):
            labels[i][rows], at = part_of_row[at : at + len(rows)], at + len(rows)
    for partition, label in zip(partitions, labels):
        staging.write_split(partition, pa.table({"part": label}))
    log.info(
        "planning: scopes cut in parts of about %d records: %s",
        config.planning.shard_rows,
        {scope: len(rows) for scope, rows in cut.items()},
    )
    return cut


# -- cluster: one shard of scopes --------------------------------------------------------------------
class PartitionTexts:
    """Cleaned texts of keyed partitions, read back on demand and kept in a bounded LRU: the guards
    compare few pairs, and those mostly within a few partitions."""

    def __init__(self, staging, budget: int = TEXT_CACHE_BYTES):
        self.staging, self.budget = staging, budget
        self.loaded: OrderedDict[str, pa.ChunkedArray] = OrderedDict()
        self.size = 0

    def text(self, partition: str, row: int) -> str:
        texts = self.loaded.get(partition)
        if texts is None:
            texts = self.staging.keyed(partition, columns=["text"])["text"]
            self.loaded[partition] = texts
            self.size += texts.nbytes
            while self.size > self.budget and len(self.loaded) > 1:
                _, old = self.loaded.popitem(last=False)
                self.size -= old.nbytes
        else:
            self.loaded.move_to_end(partition)
        return texts[row].as_py()


def cluster_shard(
    config: TokenmillConfig,
    job_id: str,
    staging,
    scopes: list[list],
    cut: set[str],
    partitions: list[str],
    duplicates: dict[str, list[int]],
    cache=None,
    shard: int = 0,
) -> DedupStats:
    """Cluster the records of `scopes` ([scope, part]: a whole scope, or one part of a scope in `cut`), in
    job order (`partitions` in order, rows in order), and stage each partition's reuse decisions for them
    (`reuse-<shard>`)."""
    if cache is None and config.cache.enabled:
        from pipeline.stores.cache import open_store

        cache = open_store(config.cache)
    wanted = pa.array([scope for scope, _ in scopes if scope not in cut], pa.string())
    parts_of = [(scope, part) for scope, part in scopes if scope in cut]
    tables = []
    for partition in partitions:
        keyed = staging.sketch(partition)
        keep = pc.is_in(keyed["scope"], wanted)
        if parts_of:
            label = staging.split(partition)["part"]
            for scope, part in parts_of:
                keep = pc.or_(keep, pc.and_(pc.equal(keyed["scope"], scope), pc.equal(label, part)))
        if partition in duplicates:
            keep = pc.and_(keep, pc.invert(pc.is_in(keyed[ROW], pa.array(duplicates[partition], pa.int32()))))
        tables.append(keyed.filter(keep))
    if not tables:  # no partition at all (an empty input folder): nothing to decide
        return DedupStats()
    records = pa.concat_tables(tables)
    if not records.num_rows:  # a shard of no record (an input without a valid one): empty decisions
        for partition in partitions:
            staging.write_reuse(partition, shard, DECISIONS.empty_table())
        return DedupStats()
    texts = PartitionTexts(staging)
    partition_of = pc.dictionary_encode(records["partition"].combine_chunks())
    indices, names = np.asarray(partition_of.indices), partition_of.dictionary.to_pylist()
    rows = np.asarray(records[ROW].combine_chunks())
    ctx = StageContext(
        config, job_id, config.input.uri, cache, texts=lambda r: texts.text(names[indices[r]], int(rows[r]))
    )
    decided = run_stages((stage_named("cluster"),), records, ctx)
    stats = ctx.dedup
    source = np.asarray(decided["gen_source"].combine_chunks())
    elsewhere = source >= 0
    decided = (
        decided.select(["partition", ROW, "gen_key", "gen_id", "gen_tier", "reuse", "similarity", "shadow", "features"])
        .append_column(
            "gen_partition",
            pa.DictionaryArray.from_arrays(
                pa.array(np.where(elsewhere, indices[source], 0), pa.int32(), mask=~elsewhere), partition_of.dictionary
            ).cast(pa.string()),
        )
        .append_column("gen_row", pa.array(rows[source], pa.int32(), mask=~elsewhere))
        .cast(pa.schema([("partition", pa.string()), *DECISIONS]))
    )
    del records
    # The decisions keep the records' order: each partition's rows in one run, partitions in order; a
    # zero-copy slice each. (A filter per partition read every row once per partition: a folder of
    # 20,000 one-record files never finished.)
    decided = decided.drop_columns(["partition"])
    offset = 0
    for partition, table in zip(partitions, tables):
        staging.write_reuse(partition, shard, decided.slice(offset, table.num_rows))
        offset += table.num_rows
    return stats
