"""neighbours.nearest_earlier: the exact path against references, ties, zero rows, and the IVF path's recall."""

import numpy as np
import pytest

from pipeline.dedup import neighbours


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def _planted(m: int, d: int, seed: int, pairs: int, cosine: float = 0.95, alike: int = 0):
    """Random unit rows; `pairs` (earlier, later) copies at about `cosine`; `alike` rows around one vector
    (pairwise ~0.95: each has far more than 64 matches, the old function's other branch)."""
    rng = np.random.default_rng(seed)
    x = _unit(rng.standard_normal((m, d)))
    sigma = np.sqrt(1 / cosine - 1)  # |noise| = sigma: each copy is at ~1/sqrt(1+sigma^2) from the source
    rows = rng.permutation(m)
    planted = []
    for a, b in rows[: 2 * pairs].reshape(-1, 2):
        a, b = sorted((int(a), int(b)))
        x[b] = _unit((x[a] + sigma * rng.standard_normal(d) / np.sqrt(d))[None])[0]
        planted.append((a, b))
    if alike:
        base = rng.standard_normal(d)
        x[rows[2 * pairs : 2 * pairs + alike]] = _unit(
            base + 0.2 * np.linalg.norm(base) / np.sqrt(d) * rng.standard_normal((alike, d))
        )
    return x, planted


def _brute_force(x: np.ndarray, threshold: float, top: int = 4) -> dict:
    x = x.astype(np.float32)
    sims = x @ x.T
    live = x.any(axis=1)
    out = {}
    for i in range(len(x)):
        hits = sorted(
            ((float(sims[i, j]), -j) for j in range(i) if live[i] and live[j] and sims[i, j] >= threshold), reverse=True
        )
        if hits:
            out[i] = [(s, -j) for s, j in hits[:top]]
    return out


def _old_nearest_earlier(vectors, rows, threshold, block=1024, top=4):
    """cluster._nearest_earlier as it was before neighbours.py replaced it (block x n memory, O(n^2))."""
    if len(rows) < 2:
        return
    matrix = vectors[rows]
    for start in range(0, len(rows), block):
        sims = matrix[start : start + block] @ matrix[: start + block].T
        sims[np.arange(sims.shape[0])[:, None] + start <= np.arange(sims.shape[1])] = -np.inf
        above = sims >= threshold
        counts = above.sum(axis=1)
        found = {}
        few = np.flatnonzero((counts > 0) & (counts <= 64))
        if len(few):
            hit_i, hit_j = np.nonzero(above[few])
            cuts = np.flatnonzero(np.diff(hit_i)) + 1
            found.update(zip(few[hit_i[np.concatenate([[0], cuts])]].tolist(), np.split(hit_j, cuts)))
        many = np.flatnonzero(counts > 64)
        if len(many):
            found.update(zip(many.tolist(), np.argpartition(-sims[many], top - 1, axis=1)[:, :top]))
        for i in sorted(found):
            hits = sorted(((float(sims[i, j]), -int(j)) for j in found[i] if sims[i, j] >= threshold), reverse=True)
            yield rows[start + i], [(s, rows[-j]) for s, j in hits[:top]]


def _assert_same(got: dict, want: dict) -> None:
    """Same rows, same neighbours in the same order; scores equal to float32 rounding (BLAS may sum a
    dot product in another order for another tile shape)."""
    assert list(got) == list(want)
    for i in want:
        assert [j for _, j in got[i]] == [j for _, j in want[i]], i
        assert np.allclose([s for s, _ in got[i]], [s for s, _ in want[i]], rtol=0, atol=1e-6), i


@pytest.fixture(params=["default tiles", "small tiles"])
def tiles(request, monkeypatch):
    """Small tiles put query blocks, candidate blocks and the many-matches cut across tile boundaries."""
    if request.param == "small tiles":
        monkeypatch.setattr(neighbours, "QUERY_BLOCK", 48)
        monkeypatch.setattr(neighbours, "CANDIDATE_BLOCK", 80)
        monkeypatch.setattr(neighbours, "FEW", 3)
    return request.param


def test_exact_path_equals_brute_force(tiles):
    x, _ = _planted(400, 32, seed=1, pairs=80, alike=60)
    for top in (1, 4):
        _assert_same(neighbours.nearest_earlier(x, 0.85, top=top), _brute_force(x, 0.85, top))


@pytest.mark.parametrize("alike", [0, 400])
def test_exact_path_equals_the_old_function(tiles, alike):
    x, _ = _planted(1500, 48, seed=2, pairs=300, alike=alike)
    want = dict(_old_nearest_earlier(x, list(range(len(x))), 0.9))
    assert len(want) >= 250  # the planted pairs (and, with alike rows, over 64 matches per row for most)
    assert sum(len(v) == 4 for v in want.values()) >= (300 if alike else 0)
    _assert_same(neighbours.nearest_earlier(x, 0.9), want)


def test_float16_is_converted_per_tile(tiles):
    x, _ = _planted(600, 32, seed=3, pairs=100, alike=50)
    half = x.astype(np.float16)
    assert neighbours.nearest_earlier(half, 0.9) == neighbours.nearest_earlier(half.astype(np.float32), 0.9)


def test_ties_go_to_the_earlier_row(tiles):
    # Rows from {+-0.5}^4: every cosine is exactly 1, 0.5, 0, -0.5 or -1, so ties are real ties.
    rng = np.random.default_rng(4)
    x = np.zeros((300, 8), np.float32)
    x[:, :4] = rng.choice([-0.5, 0.5], size=(300, 4))
    x[200:] = x[7]  # a long run of copies of row 7: over FEW matches per row, all tied at 1.0
    got = neighbours.nearest_earlier(x, 0.5)
    assert got == _brute_force(x, 0.5)  # exact arithmetic: scores equal exactly
    copies = [j for j in range(300) if (x[j] == x[7]).all()]
    assert got[250] == [(1.0, j) for j in copies[:4]]
    assert got[copies[1]][0] == (1.0, copies[0])
    # IVF (k-means over 16 distinct points: empty cells restart): copies share a cell, so a row with
    # four earlier copies gets exactly those, the earliest ones.
    ivf = neighbours.nearest_earlier(x, 0.5, exact_max=10)
    for i in range(300):
        if sum((x[j] == x[i]).all() for j in range(i)) >= 4:
            assert ivf[i] == got[i], i


def test_zero_rows_never_match(tiles):
    x, _ = _planted(300, 16, seed=5, pairs=40)
    zero = [0, 5, 99, 150, 299]
    x[zero] = 0
    for exact_max in (20_000, 50):  # exact, then IVF
        # threshold -1: every live pair matches, zero rows (cosine 0) would too, were they not excluded
        got = neighbours.nearest_earlier(x, -1.0, exact_max=exact_max)
        assert not set(zero) & set(got)
        assert not set(zero) & {j for v in got.values() for _, j in v}
        if exact_max > len(x):
            assert len(got) == 300 - len(zero) - 1  # every live row but the first has an earlier live row
    assert neighbours.nearest_earlier(np.zeros((10, 4), np.float32), -1.0) == {}


def test_ivf_finds_planted_pairs_and_only_real_ones():
    x, planted = _planted(6000, 64, seed=6, pairs=600)
    got = neighbours.nearest_earlier(x, 0.9, exact_max=1000)
    for i, found in got.items():
        assert 1 <= len(found) <= 4
        assert [s for s, _ in found] == sorted((s for s, _ in found), reverse=True)
        for s, j in found:
            assert j < i
            assert s >= np.float32(0.9)
            assert abs(s - float(x[i] @ x[j])) < 1e-5
    kept = sum(a in [j for _, j in got.get(b, [])] for a, b in planted)
    assert kept / len(planted) >= 0.95
    assert neighbours.recall(x, 0.9, sample=300) >= 0.95


def test_ivf_is_deterministic():
    x, _ = _planted(3000, 32, seed=7, pairs=400)
    half = x.astype(np.float16)
    first = neighbours.nearest_earlier(half, 0.9, exact_max=100, seed=3)
    assert neighbours.nearest_earlier(half, 0.9, exact_max=100, seed=3) == first
    assert len(first) > 300
