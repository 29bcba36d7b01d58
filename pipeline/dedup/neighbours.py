"""Earlier neighbours by cosine, for semantic dedup: exact up to `exact_max` rows, an IVF index beyond.

The search this replaces (cluster._nearest_earlier) multiplied each block of 1024 rows by every earlier
row at once: a block x m float matrix (4 GB at m = 1M) and O(m^2) work, which one tenant scope of a
million documents cannot afford on two cores. `nearest_earlier` answers the same question ("for each
row, the earlier rows with cosine >= threshold, best first, at most `top`") in two ways:

  exact   (m <= exact_max)  the same search, tiled on both sides (query rows x candidate rows) with a
          running top-`top` per query row: memory is a tile (32 MB, ~100 MB with its masks) plus m x top
          for the running best, whatever m is. Results equal the old function's, except where it broke
          score ties arbitrarily (rows with over 64 matches: its argpartition); here ties always go to
          the earlier row.
  IVF     (m > exact_max)   spherical k-means (k ~ sqrt(m), Lloyd iterations on a seeded sample) cuts
          the rows into cells; each row is stored in the cell of its nearest centroid and queries the
          cells of its `probes` nearest centroids, exactly (the same tiles) against the earlier rows
          stored there. Work ~ probes * m^1.5 * d instead of m^2 * d; memory O(m*d + m*probes).

What IVF can miss: a neighbour stored in a cell none of the row's `probes` nearest centroids name (the
two vectors sit either side of a cell boundary, and the row is closer to `probes` other centroids than
to the neighbour's). It never invents one: every pair it returns was scored exactly and passed the
threshold. `recall` measures the share kept on given data. With probes = 3, on random unit rows plus
planted near-duplicates at cosine ~0.95 (threshold 0.9), it kept 0.997 of best neighbours at m = 100k
and 0.93 at m = 1M (more cells, more boundaries); on clustered (topical) rows, 0.9995 and 0.97. More
probes buy recall at a cost about proportional to them (probes = 6: 0.97 at 1M on random rows, with a
smaller k-means sample than now). Cells follow the data, so one dense region (thousands of near-alike
rows) makes one big cell, whose cost is quadratic in its size, as the exact search's is.

Zero rows (no embedding) match nothing, as query or as candidate, whatever the threshold.
"""

from __future__ import annotations

import math

import numpy as np

# Tile sizes: 1024 query rows x 8192 candidate rows of float32 is 32 MB, plus as much again in masks
# and copies at worst. Small enough for a worker's memory, large enough that BLAS, not Python, dominates.
QUERY_BLOCK = 1024
CANDIDATE_BLOCK = 8192
_ASSIGN_BLOCK = 4096  # rows per centroid-assignment tile: 4096 x k floats (16 MB at k = 1000)
FEW = 64  # matches per row in a tile above which a row is cut to its best `top` before merging
_KMEANS_ITERATIONS = 5
_KMEANS_SAMPLE_PER_CELL = 400  # k-means sample rows per cell (_kmeans: why so many)


def nearest_earlier(
    vectors: np.ndarray, threshold: float, top: int = 4, exact_max: int = 20_000, probes: int = 3, seed: int = 0
) -> dict[int, list[tuple[float, int]]]:
    """{i: [(cosine, j), ...]} for each row i with an earlier row j (j < i) at cosine >= `threshold`.

    At most `top` entries per row, best first, ties to the smaller j. `vectors` (m, d) float32 or float16,
    rows L2-normalised (or zero: they match nothing). Exact when m <= `exact_max`, else IVF with `probes`
    cells per row and k-means seeded by `seed` (module docstring: what it can miss)."""
    vectors = np.asarray(vectors)
    m = len(vectors)
    if m < 2 or top < 1:
        return {}
    live = _live_rows(vectors)
    best_s = np.full((m, top), -np.inf, np.float32)
    best_j = np.full((m, top), -1, np.int64)
    if m <= exact_max:
        _search(vectors, live, live, threshold, best_s, best_j)
    elif len(live) > 1:
        _ivf_search(vectors, live, threshold, probes, seed, best_s, best_j)
    return _as_dict(best_s, best_j)


def recall(vectors: np.ndarray, threshold: float, sample: int = 2000, seed: int = 0, probes: int = 3) -> float:
    """Share of rows whose exact best earlier neighbour the IVF search also returns as its best.

    Over up to `sample` random rows that have an exact neighbour; NaN when none has. Finding them scans
    rows in random order with the exact search, so its cost is ~ sample / (share of rows with a neighbour)
    queries against the whole data: seconds at m = 100k, minutes at 1M when neighbours are sparse."""
    vectors = np.asarray(vectors)
    m = len(vectors)
    found = nearest_earlier(vectors, threshold, top=1, exact_max=0, probes=probes, seed=seed)
    live = _live_rows(vectors)
    is_live = np.zeros(m, bool)
    is_live[live] = True
    best_s = np.full((m, 1), -np.inf, np.float32)
    best_j = np.full((m, 1), -1, np.int64)
    picked: list[int] = []
    order = np.random.default_rng(seed).permutation(m)
    for start in range(0, m, QUERY_BLOCK):
        if len(picked) >= sample:
            break
        batch = order[start : start + QUERY_BLOCK]
        queries = np.sort(batch[is_live[batch]])
        _search(vectors, queries, live, threshold, best_s, best_j)
        picked.extend(int(i) for i in batch if best_j[i, 0] >= 0)  # permutation order: a random sample
    picked = picked[:sample]
    if not picked:
        return float("nan")
    # A tie (another row at the same score, found instead) counts as found: it is as good a match.
    hits = sum(
        1
        for i in picked
        if i in found and (found[i][0][1] == best_j[i, 0] or found[i][0][0] >= float(best_s[i, 0]) - 1e-6)
    )
    return hits / len(picked)


# -- exact tiles -----------------------------------------------------------------------------------------
def _live_rows(vectors: np.ndarray) -> np.ndarray:
    """Indices of the non-zero rows, ascending (in blocks: no m x d boolean temporary)."""
    step = 65536
    return np.concatenate(
        [np.flatnonzero(vectors[s : s + step].any(axis=1)) + s for s in range(0, len(vectors), step)]
        or [np.zeros(0, np.int64)]
    ).astype(np.int64)


def _search(
    vectors: np.ndarray,
    queries: np.ndarray,
    stored: np.ndarray,
    threshold: float,
    best_s: np.ndarray,
    best_j: np.ndarray,
) -> None:
    """Fold into best_* (rows indexed by global row) the matches of `queries` among earlier `stored` rows.

    Both index arrays ascending. Tiles entirely at or after a query block's last row are skipped: with
    ascending indices that halves the work, as the old triangular blocks did."""
    if not len(queries) or not len(stored):
        return
    # Queries before the first stored row have nothing earlier: skip them.
    queries = queries[np.searchsorted(queries, stored[0], side="right") :]
    for qs in range(0, len(queries), QUERY_BLOCK):
        q_idx = queries[qs : qs + QUERY_BLOCK]
        end = int(np.searchsorted(stored, q_idx[-1]))  # stored rows earlier than the block's last query
        q_vec = vectors[q_idx].astype(np.float32, copy=False)  # float16 input: converted one tile at a time
        for cs in range(0, end, CANDIDATE_BLOCK):
            c_idx = stored[cs : min(cs + CANDIDATE_BLOCK, end)]
            c_vec = vectors[c_idx].astype(np.float32, copy=False)
            rows, cols, scores = _tile(q_vec @ c_vec.T, q_idx, c_idx, threshold, best_s.shape[1])
            _merge(best_s, best_j, q_idx[rows], c_idx[cols], scores)


def _tile(
    sims: np.ndarray, q_idx: np.ndarray, c_idx: np.ndarray, threshold: float, top: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The (query position, candidate position, score) matches of one tile worth merging: each query
    row's best `top` at least, earlier candidates only.

    Two shapes: most rows match nothing or a few rows (list them all: cheap); some rows match thousands
    (many alike documents): cut those to their best `top` in the tile first, or the merge sorts millions."""
    overlap = c_idx[-1] >= q_idx[0]  # else every candidate is earlier than every query: no mask needed
    above = sims >= threshold
    counts = np.count_nonzero(above, axis=1)
    many = np.flatnonzero(counts > FEW)
    parts = []
    if len(many):
        above[many] = False
        parts.append(_best_of(sims[many], many, q_idx, c_idx, threshold, top, overlap))
    rows, cols = np.nonzero(above)
    if overlap:
        earlier = c_idx[cols] < q_idx[rows]
        rows, cols = rows[earlier], cols[earlier]
    parts.append((rows, cols, sims[rows, cols]))
    if len(parts) == 1:
        return parts[0]
    return tuple(np.concatenate(p) for p in zip(*parts))


def _best_of(
    sub: np.ndarray, many: np.ndarray, q_idx: np.ndarray, c_idx: np.ndarray, threshold: float, top: int, overlap: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each row's best `top` entries at or above the threshold, ties to the earlier candidate.

    argpartition alone picks among tied scores arbitrarily (alike documents tie often), so: the top-th
    best score is the cut; everything above it is in, and of the entries equal to it, the first ones."""
    if overlap:
        sub[c_idx[None, :] >= q_idx[many, None]] = -np.inf
    width = sub.shape[1]
    if width > top:
        cut = np.partition(sub, width - top, axis=1)[:, width - top]
        cut = np.maximum(cut, np.float32(threshold))
    else:
        cut = np.full(len(sub), threshold, np.float32)
    take = sub > cut[:, None]
    need = top - np.count_nonzero(take, axis=1)
    tied = sub == cut[:, None]
    if (np.count_nonzero(tied, axis=1) > need).any():
        tied &= np.cumsum(tied, axis=1, dtype=np.int32) <= need[:, None]  # columns ascend: earliest first
    take |= tied
    rows, cols = np.nonzero(take)
    return many[rows], cols, sub[rows, cols]


def _merge(best_s: np.ndarray, best_j: np.ndarray, rows: np.ndarray, cols: np.ndarray, scores: np.ndarray) -> None:
    """Fold new matches (global row, global column, score) into each row's running best `top`."""
    if not len(rows):
        return
    top = best_s.shape[1]
    uniq, inv = np.unique(rows, return_inverse=True)
    old_s, old_j = best_s[uniq], best_j[uniq]
    kept = old_j >= 0
    r = np.concatenate([np.repeat(np.arange(len(uniq)), top)[kept.ravel()], inv])
    s = np.concatenate([old_s[kept], scores.astype(np.float32, copy=False)])
    j = np.concatenate([old_j[kept], cols])
    order = np.lexsort((j, -s, r))  # by row, then best score, then earliest column
    r, s, j = r[order], s[order], j[order]
    rank = np.arange(len(r)) - np.searchsorted(r, r)
    keep = rank < top
    new_s = np.full((len(uniq), top), -np.inf, np.float32)
    new_j = np.full((len(uniq), top), -1, np.int64)
    new_s[r[keep], rank[keep]] = s[keep]
    new_j[r[keep], rank[keep]] = j[keep]
    best_s[uniq], best_j[uniq] = new_s, new_j


def _as_dict(best_s: np.ndarray, best_j: np.ndarray) -> dict[int, list[tuple[float, int]]]:
    rows = np.flatnonzero(best_j[:, 0] >= 0)
    out = {}
    for i, ss, jj in zip(rows.tolist(), best_s[rows].tolist(), best_j[rows].tolist()):
        out[i] = [(s, j) for s, j in zip(ss, jj) if j >= 0]
    return out


# -- IVF -------------------------------------------------------------------------------------------------
def _ivf_search(
    vectors: np.ndarray,
    live: np.ndarray,
    threshold: float,
    probes: int,
    seed: int,
    best_s: np.ndarray,
    best_j: np.ndarray,
) -> None:
    n = len(live)
    k = max(1, min(n, round(math.sqrt(n))))
    probes = max(1, min(probes, k))
    rng = np.random.default_rng(seed)
    # Sorted sample: the gather reads the array front to back (it may be a memory map).
    sample = live[np.sort(rng.choice(n, size=min(n, _KMEANS_SAMPLE_PER_CELL * k), replace=False))]
    centroids = _kmeans(vectors[sample], k, rng)  # float16 stays float16: converted per tile
    own, probe = _assign(vectors, live, centroids, probes)
    # Stable sorts keep rows ascending inside each cell, which _search needs and which skips later rows.
    order = np.argsort(own, kind="stable")
    stored = live[order]
    stored_at = np.searchsorted(own[order], np.arange(k + 1))
    flat = probe.ravel()
    order = np.argsort(flat, kind="stable")
    queries = live[order // probes]
    queries_at = np.searchsorted(flat[order], np.arange(k + 1))
    del flat, order, probe, own
    for c in range(k):
        # A row is stored in one cell and queries distinct cells, so no pair is scored twice.
        _search(
            vectors,
            queries[queries_at[c] : queries_at[c + 1]],
            stored[stored_at[c] : stored_at[c + 1]],
            threshold,
            best_s,
            best_j,
        )


def _kmeans(sample: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """Spherical k-means (cosine): unit centroids, a few Lloyd iterations from k distinct sample rows.

    Cells only need to keep near neighbours together, not to converge: a few iterations do (5 and 12
    measured the same). The sample size matters more: a centroid averaged over few rows in 256 dimensions
    is noisy, and its cell boundary then cuts many more near-duplicate pairs. Recall on random unit rows
    with planted near-duplicates, probes = 3: at m = 100k, 0.93 / 0.99 / 0.997 with 40 / 200 / 400 sample
    rows per cell; at m = 1M, 0.89 / 0.93 with 200 / 400. The sample stays in the input's dtype."""
    from scipy.sparse import csr_matrix

    centroids = sample[np.sort(rng.choice(len(sample), size=k, replace=False))].astype(np.float32)
    for _ in range(_KMEANS_ITERATIONS):
        labels, score = _nearest(sample, centroids)
        sums = np.zeros_like(centroids)
        step = 32768
        for s in range(0, len(sample), step):  # a sparse one-hot product: far faster than np.add.at
            part = labels[s : s + step]
            onehot = csr_matrix((np.ones(len(part), np.float32), (part, np.arange(len(part)))), shape=(k, len(part)))
            sums += onehot @ sample[s : s + step].astype(np.float32, copy=False)
        empty = np.flatnonzero(np.bincount(labels, minlength=k) == 0)
        if len(empty):
            # An empty cell restarts at the sample rows worst served by their centroid: it splits a wide cell.
            sums[empty] = sample[np.argsort(score, kind="stable")[: len(empty)]]
        norms = np.linalg.norm(sums, axis=1, keepdims=True)
        centroids = (sums / np.where(norms > 0, norms, 1)).astype(np.float32)
    return centroids


def _nearest(x: np.ndarray, centroids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's nearest centroid and its cosine, in row tiles (never rows x k at once)."""
    labels = np.empty(len(x), np.int64)
    score = np.empty(len(x), np.float32)
    for s in range(0, len(x), _ASSIGN_BLOCK):
        sims = x[s : s + _ASSIGN_BLOCK].astype(np.float32, copy=False) @ centroids.T
        labels[s : s + _ASSIGN_BLOCK] = sims.argmax(axis=1)
        score[s : s + _ASSIGN_BLOCK] = sims[np.arange(len(sims)), labels[s : s + _ASSIGN_BLOCK]]
    return labels, score


def _assign(vectors: np.ndarray, live: np.ndarray, centroids: np.ndarray, probes: int) -> tuple[np.ndarray, np.ndarray]:
    """Per live row: the cell it is stored in (nearest centroid) and the `probes` cells it queries (its
    nearest centroids, its own first), in row tiles."""
    probe = np.empty((len(live), probes), np.int32)
    for s in range(0, len(live), _ASSIGN_BLOCK):
        sims = vectors[live[s : s + _ASSIGN_BLOCK]].astype(np.float32, copy=False) @ centroids.T
        rows = np.arange(len(sims))
        for p in range(probes):  # a few argmax passes beat argpartition over k columns, and order the probes
            best = sims.argmax(axis=1)
            probe[s : s + _ASSIGN_BLOCK, p] = best
            sims[rows, best] = -np.inf
    return probe[:, 0].copy(), probe
