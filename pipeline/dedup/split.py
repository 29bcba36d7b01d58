"""Dedup: cut a job's records into shards that cluster apart, each in a planning process of its own.

A shard holds whole tenant scopes where they are small enough (scopes never share an output, so
nothing is missed). A scope larger than a shard is cut into parts of whole connected components of
its LSH band buckets: two records that share a band bucket (the only pairs near dedup ever compares,
cluster.py `_near_pass`) are always in one part, and so are exact copies (one signature, or one item
key when near dedup is off). Exact and near reuse are therefore the same as in one piece. What a cut
scope can miss is a semantic pair (embedding neighbours, compared across the whole scope) whose
records fall in different parts; parts are cut along a projection of the embeddings to keep most
together, and benchmarks/planning_scale.py counts what is lost against an uncut plan.
"""

from __future__ import annotations

import heapq

import numpy as np
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components


def components(band_hashes: np.ndarray) -> np.ndarray:
    """Connected component of each row (int32[n]): rows are linked when they share a hash in one band."""
    n, bands = band_hashes.shape
    src, dst = [], []
    for b in range(bands):
        order = np.argsort(band_hashes[:, b], kind="stable")
        same = band_hashes[order[1:], b] == band_hashes[order[:-1], b]
        src.append(order[:-1][same])
        dst.append(order[1:][same])
    edges = np.concatenate(src), np.concatenate(dst)
    graph = coo_matrix((np.ones(len(edges[0]), np.int8), edges), shape=(n, n))
    return connected_components(graph, directed=False)[1].astype(np.int32)


def parts(component: np.ndarray, count: int, position: np.ndarray | None = None) -> np.ndarray:
    """Part of each row (int32[n], 0..count-1): the components in order of their first row's `position`
    (default: the row's own index), cut into `count` runs of about equal rows. A component is never cut,
    so a part may exceed an equal share by up to its largest component. Deterministic.

    `position`: a projection of each row's embedding on one fixed direction (`semantic_positions`):
    semantic neighbours project close together, so most of them share a run (RESULTS.md §9: 15% of
    nearest-neighbour pairs across 5 parts, against 58% in job order)."""
    sizes = np.bincount(component)
    first = np.full(len(sizes), len(component))
    np.minimum.at(first, component, np.arange(len(component)))
    order = np.lexsort((first, first if position is None else position[first]))
    before = np.cumsum(sizes[order]) - sizes[order]
    part_of = np.empty(len(sizes), np.int32)
    part_of[order] = np.minimum(before * count // max(len(component), 1), count - 1)
    return part_of[component]


def semantic_positions(vectors: np.ndarray) -> np.ndarray:
    """Each row's embedding projected on one fixed pseudo-random direction (the same for every job)."""
    direction = np.random.default_rng(19).standard_normal(vectors.shape[1]).astype(np.float32)
    return vectors.astype(np.float32) @ direction


def shards_of(scope_rows: dict[tuple[str, int], int], shards: int) -> list[list[tuple[str, int]]]:
    """Scopes (scope, part) in at most `shards` shards of about equal rows: the largest first, to the
    lightest shard. Deterministic (ties by name), and empty shards are dropped."""
    heap = [(0, i, []) for i in range(max(1, shards))]
    for scope, rows in sorted(scope_rows.items(), key=lambda kv: (-kv[1], kv[0])):
        load, i, scopes = heapq.heappop(heap)
        scopes.append(scope)
        heapq.heappush(heap, (load + rows, i, scopes))
    return [sorted(scopes) for _, _, scopes in sorted(heap, key=lambda t: t[1]) if scopes]
