"""Dedup: generate once per meaning-equivalent document; every other copy reuses that output.

Three kinds of reuse inside a job, tried in this order on the records left over by the previous one:
  exact      same tenant scope and normalised text (NFC, whitespace collapsed, boilerplate stripped,
             optionally case-folded) -> same content hash -> same item key;
  near       MinHash LSH over word shingles, estimated Jaccard >= `near_threshold`;
  semantic   static-embedding cosine >= `semantic_threshold` (off unless an embedder is configured).
Near and semantic matches must also pass the meaning guards (numbers, negations, entities, length;
see guards.py). The first record of a cluster (job order) is its representative, unless a later
member is routed to a dearer tier: that one then represents the cluster, since a record may reuse
an output of a tier at least as dear as its own, never a cheaper one.

Against earlier jobs the same near and semantic lookups run on the cache index (index.py), and the
exact lookup runs by item key when a partition runs. Tenants never share an output unless they are
listed together in `dedup.shared_tenants`.

Columns added (all read by the partition runner and the writer):
  scope, content_hash       tenant scope and content hash (the item key is built from them)
  gen_key                   item key whose output this record gets (its own `item_key` unless it reuses)
  gen_id, gen_text          the representative's id, and its text when it sits in another partition
  gen_tier                  the tier that generates gen_key (a member may reuse a higher tier's output)
  reuse, similarity         near_duplicate | semantic | cache_near | cache_semantic, and the score
  shadow                    reused, but generated anyway to measure the false-hit rate
  signature, embedding      what the cache index stores for a generated record (sketch.py; added first when missing)
  features                  its guard features (JSON), when clustering needed them (else computed at indexing)
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash

from pipeline.config import DedupConfig, SamplingConfig
from pipeline.dedup import guards, minhash, neighbours
from pipeline.dedup.sketch import Embedder, embedding_matrix, signature_matrix, sketch_records
from pipeline.keys import clean_text, compile_boilerplate, content_hash, key_bytes, request_scope, tenant_scope

log = logging.getLogger(__name__)
REUSE_KINDS = ("near_duplicate", "semantic", "cache_near", "cache_semantic")


@dataclass
class DedupStats:
    """What the stage found, for the staging section of the manifest."""

    clusters: Counter = field(default_factory=Counter)  # records per reuse kind
    refused: Counter = field(default_factory=Counter)  # similar pairs the guards refused, by guard
    cache_index: dict = field(default_factory=dict)  # entries loaded per scope
    seconds: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)  # what was asked for and could not be done

    def merge(self, other: "DedupStats") -> None:
        """Add a shard's figures (seconds add up: they are CPU-seconds across shards; a scope's cache index
        is the same in every shard that searches it)."""
        self.clusters.update(other.clusters)
        self.refused.update(other.refused)
        for scope, n in other.cache_index.items():  # the parts of a cut scope each load its whole index: once
            self.cache_index[scope] = max(self.cache_index.get(scope, 0), n)
        for step, seconds in other.seconds.items():
            self.seconds[step] = self.seconds.get(step, 0.0) + seconds
        self.notes.extend(n for n in other.notes if n not in self.notes)

    def to_dict(self) -> dict:  # everything, for a shard's figures to travel (as_dict: the manifest's summary)
        return {
            "clusters": dict(self.clusters),
            "refused": dict(self.refused),
            "cache_index": self.cache_index,
            "seconds": self.seconds,
            "notes": self.notes,
        }

    @staticmethod
    def from_dict(data: dict) -> "DedupStats":
        return DedupStats(
            Counter(data["clusters"]),
            Counter(data["refused"]),
            dict(data["cache_index"]),
            dict(data["seconds"]),
            list(data["notes"]),
        )

    def as_dict(self) -> dict:
        return {
            "reused": dict(self.clusters),
            "guard_refusals": dict(self.refused),
            "cache_index_entries": sum(self.cache_index.values()),
            "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
            "notes": self.notes,
        }


def add_content_hashes(
    records: pa.Table,
    config: DedupConfig,
    own_scope: frozenset[str] = frozenset(),
    sampling: SamplingConfig | None = None,
) -> pa.Table:
    """Add `scope` and `content_hash`: equal for exact duplicates; the record's id joins it when exact dedup is off.

    `own_scope`: tenants that keep their own scope even when listed in `shared_tenants` (those with a
    LoRA adapter: another tenant's near or semantic match must never be served an adapter's output)."""
    shared = set(config.shared_tenants) - own_scope
    boilerplate = compile_boilerplate(config.boilerplate_patterns)
    scopes = [tenant_scope(t, shared) for t in records["tenant"].to_pylist()]
    if "request" in records.column_names and records["request"].null_count < records.num_rows:
        sampling = sampling or SamplingConfig()
        requests = records["request"].to_pylist()
        scopes = [s if r is None else request_scope(s, r, sampling) for s, r in zip(scopes, requests)]
    hashes = [
        content_hash(s, x, config.case_fold, boilerplate)
        if config.exact
        else xxhash.xxh3_128_hexdigest(key_bytes(s, i, x))
        for i, s, x in zip(records["id"].to_pylist(), scopes, records["text"].to_pylist())
    ]
    return records.append_column("scope", pa.array(scopes, pa.string())).append_column(
        "content_hash", pa.array(hashes, pa.string())
    )


def shadow_selected(item_key: str, rate: float) -> bool:
    """Deterministic sample: the same items are verified on every rerun."""
    return rate > 0 and xxhash.xxh64_intdigest(item_key.encode()) < rate * 2**64


# -- the stage -----------------------------------------------------------------------------------------
class _Clusters:
    """Representatives and members over the records of a job; index i is the record's row."""

    def __init__(self, n: int):
        self.rep = np.arange(n)  # row of the representative (numpy: 8 bytes a row, not 36)
        self.kind: list[str | None] = [None] * n
        self.similarity: list[float | None] = [None] * n
        self.cached: dict[int, tuple[str, str, float]] = {}  # rep row -> (cache key, kind, similarity)
        self.members: dict[int, list[int]] = {}  # rep row -> rows joined to it

    def join(self, member: int, rep: int, kind: str, similarity: float) -> None:
        self.rep[member], self.kind[member], self.similarity[member] = rep, kind, similarity
        self.members.setdefault(rep, []).append(member)

    def promote(self, new: int, old: int, kind: str, similarity: float) -> None:
        """`new` (a later record on a dearer tier) represents `old`'s cluster: one generation instead of two."""
        for member in self.members.pop(old, []):
            self.rep[member] = new
            self.members.setdefault(new, []).append(member)
        self.join(old, new, kind, similarity)


def cluster_records(
    records: pa.Table,
    config: DedupConfig,
    embedder: Embedder | None = None,
    cache=None,
    tier_rank: dict[str, float] | None = None,
    adapters: list[str | None] | None = None,
) -> tuple[pa.Table, DedupStats]:
    """Add the reuse columns (module docstring) to keyed records (`scope`, `recipe`, `item_key`, `partition`, `tier`).

    `tier_rank` (tier -> price): a record may reuse a representative routed to a tier ranked at least
    as high as its own (a mirror copy whose header hid a routing rule still reuses the large tier's
    output), never a lower one. Without it, only the same tier. `adapters`: per row, the digest of the
    LoRA adapter it runs with; a record only reuses outputs made with its own (none: the base model).

    In memory, for a table that fits: a job's planning (pipeline/plan/stages.py) runs the same steps,
    `sketch_records` per file and `cluster_rows` per shard of scopes, with texts read back on demand."""
    sketched = records
    if "signature" not in records.column_names:
        sketched = sketch_records(records, config, embedder, cache is not None)
    raw = records["text"].to_pylist()
    out, stats = cluster_rows(sketched, config, raw.__getitem__, cache, tier_rank, adapters)
    gen_text = pa.array([raw[s] if s >= 0 else None for s in out["gen_source"].to_pylist()], pa.string())
    return out.drop_columns(["gen_source"]).append_column("gen_text", gen_text).select(
        [c for c in sketched.column_names] + list(REUSE_COLUMNS)
    ), stats


def cluster_rows(
    records: pa.Table,
    config: DedupConfig,
    text_of,
    cache=None,
    tier_rank: dict[str, float] | None = None,
    adapters: list[str | None] | None = None,
) -> tuple[pa.Table, DedupStats]:
    """Sketched records with the reuse columns and `gen_source` (reuse_columns), and the statistics.
    `text_of(row)`: the row's raw text, read only for the pairs the guards compare."""
    boilerplate = compile_boilerplate(config.boilerplate_patterns)
    plan = reuse_plan(records, config, lambda row: clean_text(text_of(row), boilerplate), cache, tier_rank, adapters)
    return reuse_columns(records, plan, config), plan.stats


REUSE_COLUMNS = ("gen_key", "gen_id", "gen_text", "gen_tier", "reuse", "similarity", "shadow", "features")


@dataclass
class ReusePlan:
    """Who reuses whom among a table's rows: `clusters` (in-job reuse), cached (an earlier job's
    output), the guard features computed on the way, and the stage's statistics."""

    clusters: "_Clusters"
    features: list
    stats: DedupStats


def reuse_plan(
    records: pa.Table,
    config: DedupConfig,
    text_of,
    cache=None,
    tier_rank: dict[str, float] | None = None,
    adapters: list[str | None] | None = None,
) -> ReusePlan:
    """Cluster sketched records (`sketch_records`' columns plus `scope`, `recipe`, `item_key`, `tier`).

    `text_of(row)`: the row's cleaned text, asked for only when the guards compare a pair (the
    features of both, and the text itself when their features disagree). Semantic reuse runs where the
    records carry embeddings (an embedder was configured and loaded)."""
    stats = DedupStats()
    n = records.num_rows
    groups, in_job = _first_rows(records)
    clusters = _Clusters(n)
    feats: list[guards.Features | None] = [None] * n
    tier_codes, tier_names = _codes(records["tier"])
    tiers = [tier_names[t] for t in tier_codes.tolist()]  # a few distinct strings, shared

    def servable(row: int, rep: int) -> bool:
        if adapters is not None and adapters[row] != adapters[rep]:
            return False
        if tiers[row] == tiers[rep]:
            return True
        return tier_rank is not None and tier_rank.get(tiers[row], 0.0) <= tier_rank.get(tiers[rep], 0.0)

    def feature(row: int) -> guards.Features:
        if feats[row] is None:
            feats[row] = guards.features(text_of(row))
        return feats[row]

    def attach(row: int, close: list[tuple[float, int]], kind: str) -> bool:
        """Join `row` to the best representative in `close` (score, rep) that may serve it; failing that,
        let `row` represent the best one on a cheaper tier. True when `row` joined a cluster."""
        match = next(((s, c) for s, c in close if servable(row, c) and agree(row, c)), None)
        if match is not None:
            clusters.join(row, match[1], kind, match[0])
            return True
        promoted = next(((s, c) for s, c in close if not servable(row, c) and servable(c, row) and agree(row, c)), None)
        if promoted is not None:  # an earlier copy on a cheaper tier reuses this one's output
            clusters.promote(row, promoted[1], kind, promoted[0])
        return False

    verdicts: dict[tuple[int, int], bool] = {}  # the semantic pass meets many pairs the near pass judged

    def agree(a: int, b: int) -> bool:
        if not config.guards:
            return True
        if (a, b) not in verdicts:
            fa, fb = feature(a), feature(b)
            failed = guards.features_agree(fa, fb, config.max_length_ratio)
            if failed is not None and failed != "length":  # only then do the texts themselves matter
                failed = guards.texts_agree(text_of(a), text_of(b), config.max_length_ratio, fa, fb)
            if failed:
                stats.refused[failed] += 1
            verdicts[a, b] = failed is None
        return verdicts[a, b]

    started = time.perf_counter()
    sigs = signature_matrix(records, config.num_perm)
    if config.near:
        _near_pass(in_job, sigs, clusters, attach, config)
    stats.seconds["near"] = time.perf_counter() - started

    started = time.perf_counter()
    vectors = embedding_matrix(records)
    if vectors is not None and config.semantic:
        _semantic_pass(vectors, in_job, clusters, attach, config)
    stats.seconds["semantic"] = time.perf_counter() - started

    started = time.perf_counter()
    if cache is not None:
        _match_cache(records, groups, clusters, sigs, vectors, feature, config, cache, stats)
    stats.seconds["cache_lookup"] = time.perf_counter() - started
    return ReusePlan(clusters, feats, stats)


def _codes(column) -> tuple[np.ndarray, list[str]]:
    """Dictionary codes (first-appearance order) and distinct values of a string column."""
    encoded = pc.dictionary_encode(column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column)
    return np.asarray(encoded.indices), encoded.dictionary.to_pylist()


def _first_rows(records: pa.Table) -> tuple[dict[tuple[str, str], list[int]], dict[str, np.ndarray]]:
    """The first row of each item key, in job order: per (scope, recipe), and per scope (any tier)."""
    keys, _ = _codes(records["item_key"])
    _, firsts = np.unique(keys, return_index=True)
    firsts.sort()
    scopes, scope_names = _codes(records["scope"])
    recipes, recipe_names = _codes(records["recipe"])
    group = scopes[firsts].astype(np.int64) * len(recipe_names) + recipes[firsts]
    groups: dict[tuple[str, str], list[int]] = {}
    for g in dict.fromkeys(group.tolist()):  # first-appearance order, as the rows come
        groups[scope_names[g // len(recipe_names)], recipe_names[g % len(recipe_names)]] = firsts[group == g].tolist()
    in_job = {scope_names[s]: firsts[scopes[firsts] == s] for s in dict.fromkeys(scopes[firsts].tolist())}
    return groups, in_job


def _near_pass(
    in_job: dict[str, list[int]], sigs: np.ndarray, clusters: _Clusters, attach, config: DedupConfig
) -> None:
    """MinHash LSH per scope, in job order: each row joins the best earlier representative it may reuse.

    Candidates are the rows indexed so far (those that joined no cluster) sharing a band bucket."""
    for rows in in_job.values():
        buckets = minhash.LshBuckets(sigs[rows], config.near_threshold, config.num_perm)
        indexed: dict[int, list[int]] = {}  # shared bucket -> rows indexed in it, in job order
        for i, row in enumerate(rows.tolist()):
            shared = buckets.shared(i)
            if not shared:
                continue  # no other row of the scope shares a bucket: nothing to compare, nothing to index
            candidates = {c for g in shared for c in indexed.get(g, ())}
            close = sorted(
                (
                    (s, c)
                    for c in candidates
                    if clusters.rep[c] == c
                    for s in [minhash.jaccard(sigs[row], sigs[c])]
                    if s >= config.near_threshold
                ),
                reverse=True,
            )
            if not attach(row, close, "near_duplicate"):
                for g in shared:
                    indexed.setdefault(g, []).append(row)


def _semantic_pass(
    vectors: np.ndarray, in_job: dict[str, list[int]], clusters: _Clusters, attach, config: DedupConfig
) -> None:
    """Rows still representing themselves join the best earlier representative within the cosine
    threshold (neighbours.py: exact up to its `exact_max` rows per scope, an IVF index beyond)."""
    for rows in in_job.values():
        reps = rows[clusters.rep[rows] == rows].tolist()
        found = neighbours.nearest_earlier(vectors[reps], config.semantic_threshold)
        for i in sorted(found):
            attach(reps[i], [(s, reps[j]) for s, j in found[i] if clusters.rep[reps[j]] == reps[j]], "semantic")


def _match_cache(
    records, groups, clusters: _Clusters, sigs, vectors, feature, config: DedupConfig, cache, stats: DedupStats
) -> None:
    """Representatives left after in-job clustering, looked up in the near/semantic index of earlier jobs."""
    from pipeline.dedup.index import load_index

    for (scope, recipe), rows in groups.items():
        reps = [r for r in rows if clusters.rep[r] == r]
        if not reps:
            continue
        index = load_index(cache, scope, recipe)
        if index is None:
            continue
        stats.cache_index[scope] = stats.cache_index.get(scope, 0) + len(index["keys"])
        known = pc.is_in(records["item_key"].take(reps), pa.array(index["keys"].tolist(), pa.string()))
        reps = [r for r, hit in zip(reps, known.to_pylist()) if not hit]  # exact hits come from the key lookup
        index_feats: dict[int, guards.Features] = {}

        def agree(row: int, j: int, index=index, index_feats=index_feats) -> bool:
            if not config.guards:
                return True
            if j not in index_feats:
                index_feats[j] = guards.Features.from_json(str(index["features"][j]))
            failed = guards.features_agree(feature(row), index_feats[j], config.max_length_ratio, entity_subset=True)
            if failed:
                stats.refused[failed] += 1
            return failed is None

        if config.near and reps:
            stored_sigs = index["signatures"]
            buckets = minhash.LshBuckets(
                np.concatenate([stored_sigs, sigs[reps]]), config.near_threshold, config.num_perm
            )
            entries: dict[int, list[int]] = {}  # shared bucket -> index entries in it
            for j in range(len(stored_sigs)):
                for g in buckets.shared(j):
                    entries.setdefault(g, []).append(j)
            for i, row in enumerate(reps):
                candidates = {j for g in buckets.shared(len(stored_sigs) + i) for j in entries.get(g, ())}
                best = sorted(((minhash.jaccard(sigs[row], stored_sigs[j]), j) for j in candidates), reverse=True)
                match = next(((s, j) for s, j in best if s >= config.near_threshold and agree(row, j)), None)
                if match:
                    clusters.cached[row] = (str(index["keys"][match[1]]), "cache_near", match[0])
        stored = index["embeddings"].astype(np.float32)
        if config.semantic and vectors is not None and stored.shape[1] == vectors.shape[1] and stored.shape[1]:
            left = [r for r in reps if r not in clusters.cached]
            for start in range(0, len(left), 1024):
                block = left[start : start + 1024]
                sims = vectors[block].astype(np.float32) @ stored.T
                for i, row in enumerate(block):
                    for j in np.argsort(-sims[i])[:4]:
                        if sims[i, j] < config.semantic_threshold:
                            break
                        if agree(row, int(j)):
                            clusters.cached[row] = (str(index["keys"][j]), "cache_semantic", float(sims[i, j]))
                            break


def reuse_columns(records: pa.Table, plan: ReusePlan, config: DedupConfig) -> pa.Table:
    """`records` with gen_key, gen_id, gen_tier, reuse, similarity, shadow, features and `gen_source`:
    the row whose text a member needs (its representative in another partition), else -1.

    Columnar (numpy indices into Arrow columns): a shard of a million records keeps no Python object per row."""
    n, clusters, stats = records.num_rows, plan.clusters, plan.stats
    keys, _ = _codes(records["item_key"])
    _, first_of_key = np.unique(keys, return_index=True)
    first = first_of_key[keys]  # exact duplicates follow their key's first record
    rep = clusters.rep[first]
    member = rep != first  # an in-job near/semantic member
    parts, _ = _codes(records["partition"])
    source = np.where(member & (parts[rep] != parts), rep, -1)
    kind = pa.array(clusters.kind, pa.string()).take(first)
    similarity = pa.array(clusters.similarity, pa.float64()).take(first)
    gen_key = (item_key := records["item_key"].combine_chunks()).take(rep)
    gen_id = pc.if_else(pa.array(member), records["id"].combine_chunks().take(rep), pa.scalar(None, pa.string()))
    if clusters.cached:  # representatives that reuse an earlier job's output
        cached_reps = np.fromiter(clusters.cached, np.int64)
        hit = np.isin(rep, cached_reps)
        rows = np.flatnonzero(hit).tolist()
        key_of, kind_of, sim_of = ([None] * n for _ in range(3))
        for row in rows:
            key_of[row], kind_of[row], sim_of[row] = clusters.cached[int(rep[row])]
        hit_arr, own = pa.array(hit), pa.array(hit & ~member)
        gen_key = pc.if_else(hit_arr, pa.array(key_of, pa.string()), gen_key)
        gen_id = pc.if_else(hit_arr, pa.scalar(None, pa.string()), gen_id)
        source = np.where(hit, -1, source)
        kind = pc.if_else(own, pa.array(kind_of, pa.string()), kind)
        similarity = pc.if_else(own, pa.array(sim_of, pa.float64()), similarity)
    reused = np.asarray(pc.is_valid(kind))
    shadow = np.zeros(n, bool)
    if config.shadow_rate > 0:
        for row in np.flatnonzero(reused).tolist():
            shadow[row] = shadow_selected(item_key[row].as_py(), config.shadow_rate)
    for count in pc.value_counts(kind.filter(pa.array(reused))).to_pylist():
        stats.clusters[count["values"]] += count["counts"]
    # Guard features computed here are kept: the cache index stores them for generated records.
    return (
        records.append_column("gen_key", gen_key)
        .append_column("gen_id", gen_id)
        .append_column("gen_tier", records["tier"].combine_chunks().take(rep))
        .append_column("reuse", kind)
        .append_column("similarity", similarity)
        .append_column("shadow", pa.array(shadow))
        .append_column("features", pa.array([f.to_json() if f else None for f in plan.features], pa.string()))
        .append_column("gen_source", pa.array(source, pa.int64()))
    )
