"""MinHash signatures over word shingles, and LSH banding to find near-duplicate candidates fast.

A document's signature holds `num_perm` minima over its word k-shingles (one-permutation hashing
with densification, see `signatures`); the share of equal positions in two signatures estimates
the Jaccard similarity of their shingle sets.
Candidates come from LSH: the signature is cut into bands, and documents sharing any band's hash
are compared. Bands and rows are picked for the threshold so that pairs at the threshold are found
with high probability while far pairs rarely collide.

Everything is numpy over 64-bit hashes with fixed constants, vectorised over many texts at once:
signatures are the same in every process, so they can be persisted in the cache index and compared
across jobs.
"""

from __future__ import annotations

import functools

import numpy as np

_MASK32 = np.uint64(0xFFFFFFFF)
_EMPTY = np.uint64(1 << 32)  # above every 32-bit value: marks a bin no shingle fell into
_P = 0x100000001B3  # odd, so invertible mod 2**64: word hashes come from prefix sums
_Q = pow(_P, -1, 1 << 64)
_IS_SPACE = np.zeros(256, bool)
_IS_SPACE[[ord(c) for c in " \t\n\r\x0b\x0c"]] = True
_CHUNK_BYTES = (
    1 << 20
)  # texts hashed together: bounds the temporary arrays (about 10 MB each; 4 MB chunks cost 250 MB more at the peak)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every input bit moves every output bit (uint64 arithmetic wraps)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


_POWERS: list[np.ndarray] = []  # [P**i, Q**(i+1)], grown on demand and kept: every chunk slices them


def _powers(n: int) -> tuple[np.ndarray, np.ndarray]:
    """(P**i, Q**(i+1)) for i < n, mod 2**64."""
    if not _POWERS or len(_POWERS[0]) < n:
        size = max(1 << max(n - 1, 1).bit_length(), 1 << 16)
        p = np.cumprod(np.full(size, _P, np.uint64))
        _POWERS[:] = [np.concatenate([[np.uint64(1)], p[:-1]]), np.cumprod(np.full(size, _Q, np.uint64))]
    return _POWERS[0][:n], _POWERS[1][:n]


def words(texts: list[str]) -> tuple[np.ndarray, np.ndarray, tuple[bytes, np.ndarray, np.ndarray]]:
    """(64-bit hash of each whitespace-separated word, index of its text, (UTF-8 bytes of all texts,
    start, end of each word in them)), for all texts at once.

    A word's hash is the polynomial sum v_j * P**(e-j-1) of its bytes, computed for every word from
    one prefix sum (S[e] - S[s]) * P**e, where S[i] = sum v_j * Q**(j+1) and Q = 1/P: no Python loop
    over words, and the same word hashes equally wherever it stands.
    """
    encoded = [t.encode() for t in texts]
    lengths = np.fromiter((len(e) + 1 for e in encoded), np.int64, len(encoded))
    buffer = b" ".join(encoded) + b" "
    data = np.frombuffer(buffer, np.uint8)
    starts_of_text = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    sep = _IS_SPACE[data]
    edges = np.flatnonzero(np.diff(np.concatenate([[1], sep.view(np.int8), [1]])))
    word_start, word_end = edges[0::2], edges[1::2]
    with np.errstate(over="ignore"):
        p_pow, q_pow = _powers(len(data) + 1)
        prefix = np.concatenate(
            [[np.uint64(0)], np.cumsum((data.astype(np.uint64) + np.uint64(1)) * q_pow[: len(data)])]
        )
        hashes = _mix((prefix[word_end] - prefix[word_start]) * p_pow[word_end])
    return hashes, np.searchsorted(starts_of_text, word_start, side="right") - 1, (buffer, word_start, word_end)


def _runs(h: np.ndarray, k: int) -> np.ndarray:
    """Hash of each run of k (>= 1) consecutive word hashes in `h`."""
    m = len(h) - k + 1
    out = h[:m].copy()
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps, which is what we want
        for j in range(1, k):
            out = out * np.uint64(0x9E3779B97F4A7C15) + h[j : m + j]
    return out


def _shingles(hashes: np.ndarray, text_of: np.ndarray, n_texts: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(hash of each run of k consecutive words inside one text, its text); a text of fewer than k
    words is one shingle of all its words, and an empty text one shingle of value 0."""
    counts = np.bincount(text_of, minlength=n_texts)
    values, owners = [], []
    if len(hashes) >= k:
        out = _runs(hashes, k)
        keep = text_of[: len(out)] == text_of[k - 1 :]  # runs inside one text only
        values, owners = [out[keep]], [text_of[: len(out)][keep]]
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    for t in np.flatnonzero(counts < k):  # short texts: rare, so a loop is fine
        h = hashes[first[t] : first[t] + counts[t]]
        values.append(_runs(h, len(h)) if len(h) else np.zeros(1, np.uint64))
        owners.append(np.array([t]))
    return np.concatenate(values), np.concatenate(owners)


def signatures(texts: list[str], k: int = 5, num_perm: int = 128) -> np.ndarray:
    """MinHash signatures (uint32[len(texts), num_perm]) of (normalised) texts, vectorised over all of them.

    One-permutation hashing: each shingle is hashed once; its hash picks one of `num_perm` bins and
    the bin keeps its smallest value. Empty bins borrow from the next non-empty bin (rotation
    densification), so every position is filled and two texts agree in a position with probability
    equal to their Jaccard similarity, as with `num_perm` independent hash functions, at 1/num_perm
    of the hashing work.
    """
    out = np.empty((len(texts), num_perm), np.uint32)
    for start, end in chunks(texts):
        out[start:end] = _signatures(texts[start:end], k, num_perm)
    return out


def chunks(texts: list[str], max_chars: int = _CHUNK_BYTES):
    """(start, end) of consecutive runs of texts of about `max_chars` in all: bounds temporary arrays."""
    start = 0
    while start < len(texts):
        end, size = start, 0
        while end < len(texts) and (end == start or size < max_chars):
            size += len(texts[end]) + 1
            end += 1
        yield start, end
        start = end


def _signatures(texts: list[str], k: int, num_perm: int) -> np.ndarray:
    n = len(texts)
    hashes, text_of, _ = words(texts)
    shingles, owner = _shingles(hashes, text_of, n, k)
    with np.errstate(over="ignore"):
        mixed = _mix(shingles + np.uint64(0x632BE59BD9B4E019))
    bins = np.full(n * num_perm, _EMPTY, np.uint64)
    slot = owner * num_perm + ((mixed & _MASK32) % np.uint64(num_perm)).astype(np.int64)
    np.minimum.at(bins, slot, mixed >> np.uint64(32))
    bins = bins.reshape(n, num_perm)
    filled, empty = bins.copy(), bins == _EMPTY
    for step in range(1, num_perm):
        if not empty.any():
            break
        source = np.roll(bins, -step, axis=1)
        take = empty & (source != _EMPTY)
        filled[take] = (source[take] + np.uint64(step * 0x9E3779B9)) & _MASK32
        empty &= ~take
    filled[empty] = 0
    return filled.astype(np.uint32)


def signature(text: str, k: int = 5, num_perm: int = 128) -> np.ndarray:
    """MinHash signature (uint32[num_perm]) of one (normalised) text."""
    return signatures([text], k, num_perm)[0]


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Estimated Jaccard similarity of two signatures."""
    return float(np.count_nonzero(a == b)) / len(a)


@functools.lru_cache(maxsize=None)
def bands_for(threshold: float, num_perm: int) -> tuple[int, int]:
    """(bands, rows) with bands*rows <= num_perm minimising missed pairs at the threshold plus false candidates.

    A pair with similarity s shares a band with probability 1 - (1 - s^r)^b; the S-curve's steep
    part should sit just below the threshold.
    """
    best, best_cost = (1, num_perm), float("inf")
    s = np.linspace(0, 1, 201)
    below = s < threshold
    for rows in range(1, num_perm + 1):
        bands = num_perm // rows
        p = 1 - (1 - s**rows) ** bands
        # Riemann sums over the grid: the areas of false candidates and of missed pairs.
        cost = (
            p[below].sum() + 4 * (1 - p[~below]).sum()
        )  # a missed duplicate costs a generation; a candidate a compare
        if cost < best_cost:
            best, best_cost = (bands, rows), cost
    return best


def band_keys(sig: np.ndarray, bands: int, rows: int) -> list[bytes]:
    """One hashable key per band (band index included, so equal bytes in different bands differ)."""
    raw = sig[: bands * rows].reshape(bands, rows)
    return [bytes([i]) + raw[i].tobytes() for i in range(bands)]


class LshIndex:
    """Signatures grouped by band: `candidates` returns the ids sharing at least one band."""

    def __init__(self, threshold: float, num_perm: int):
        self.bands, self.rows = bands_for(threshold, num_perm)
        self.buckets: dict[bytes, list[int]] = {}

    def add(self, ref: int, sig: np.ndarray) -> None:
        for key in band_keys(sig, self.bands, self.rows):
            self.buckets.setdefault(key, []).append(ref)

    def candidates(self, sig: np.ndarray) -> list[int]:
        seen: dict[int, None] = {}
        for key in band_keys(sig, self.bands, self.rows):
            for ref in self.buckets.get(key, ()):
                seen[ref] = None
        return list(seen)


def band_hashes(sigs: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """uint64[len(sigs), bands]: one 64-bit hash per band, the band's index mixed in (equal rows in
    different bands never collide). A 64-bit collision only adds a candidate, which the Jaccard
    estimate then rejects."""
    out = np.empty((len(sigs), bands), np.uint64)
    with np.errstate(over="ignore"):
        for b in range(bands):
            h = np.full(len(sigs), np.uint64(b + 1) * np.uint64(0x9E3779B97F4A7C15), np.uint64)
            for r in range(b * rows, (b + 1) * rows):
                h = _mix(h ^ sigs[:, r].astype(np.uint64))
            out[:, b] = h
    return out


class LshBuckets:
    """The band buckets of many signatures at once, by sorting their band hashes.

    `groups[i]` lists the buckets signature i shares with at least one other signature (-1 for a band
    it has alone): int32, a few bytes per band, where `LshIndex` keeps a dict entry of about a
    kilobyte per signature. Pairs are not listed up front (a bucket of k alike documents holds k²/2
    of them); callers walk the rows in order and keep, per shared bucket, the rows they indexed."""

    def __init__(self, sigs: np.ndarray, threshold: float, num_perm: int):
        bands, rows = bands_for(threshold, num_perm)
        flat = band_hashes(sigs, bands, rows).ravel()
        order = np.argsort(flat, kind="stable")
        ordered = flat[order]
        starts = np.ones(len(flat), bool)
        starts[1:] = ordered[1:] != ordered[:-1]
        bucket = np.cumsum(starts) - 1
        shared = np.bincount(bucket)[bucket] > 1
        groups = np.full(len(flat), -1, np.int32)
        groups[order[shared]] = bucket[shared]
        self.groups = groups.reshape(len(sigs), bands)
        self.any_shared = (self.groups >= 0).any(axis=1)

    def shared(self, i: int) -> list[int]:
        """The buckets signature i shares with another (empty for most documents)."""
        if not self.any_shared[i]:
            return []
        g = self.groups[i]
        return g[g >= 0].tolist()
