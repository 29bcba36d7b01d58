"""MinHash signatures over word shingles, and LSH banding to find near-duplicate candidates fast.

A document's signature is `num_perm` minima of universal hashes over its word k-shingles; the share
of equal positions in two signatures estimates the Jaccard similarity of their shingle sets.
Candidates come from LSH: the signature is cut into bands, and documents sharing any band's hash
are compared. Bands and rows are picked for the threshold so that pairs at the threshold are found
with high probability while far pairs rarely collide.

Everything is numpy over 64-bit hashes with fixed seeds: signatures are the same in every process,
so they can be persisted in the cache index and compared across jobs.
"""

from __future__ import annotations

import functools

import numpy as np
import xxhash

_MERSENNE = np.uint64((1 << 61) - 1)
_MAX = np.uint32(0xFFFFFFFF)


def _permutations(num_perm: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(20261130)  # fixed: signatures must agree across processes and jobs
    a = rng.integers(1, (1 << 61) - 1, size=num_perm, dtype=np.uint64) | np.uint64(1)
    b = rng.integers(0, (1 << 61) - 1, size=num_perm, dtype=np.uint64)
    return a, b


_PERMS: dict[int, tuple[np.ndarray, np.ndarray]] = {}


def shingle_hashes(text: str, k: int) -> np.ndarray:
    """64-bit hashes of the text's word k-shingles (the whole text as one shingle when shorter)."""
    words = text.split()
    if not words:
        return np.zeros(1, dtype=np.uint64)
    h = np.fromiter((xxhash.xxh64_intdigest(w.encode()) for w in words), dtype=np.uint64, count=len(words))
    if len(words) < k:
        k = len(words)
    # Rolling combination of k consecutive word hashes; uint64 arithmetic wraps, which is what we want.
    with np.errstate(over="ignore"):
        out = h[: len(h) - k + 1].copy()
        for j in range(1, k):
            out = out * np.uint64(0x9E3779B97F4A7C15) + h[j: len(h) - k + 1 + j]
    return np.unique(out)


def signature(text: str, k: int = 5, num_perm: int = 128) -> np.ndarray:
    """MinHash signature (uint32[num_perm]) of a (normalised) text."""
    if num_perm not in _PERMS:
        _PERMS[num_perm] = _permutations(num_perm)
    a, b = _PERMS[num_perm]
    h = shingle_hashes(text, k)
    with np.errstate(over="ignore"):
        # Multiply-shift hashing: (a*h + b) >> 32 is a universal family on 64-bit words.
        values = (np.multiply.outer(a, h) + b[:, None]) >> np.uint64(32)
    return values.min(axis=1).astype(np.uint32)


def signatures(texts: list[str], k: int = 5, num_perm: int = 128) -> np.ndarray:
    out = np.empty((len(texts), num_perm), dtype=np.uint32)
    for i, text in enumerate(texts):
        out[i] = signature(text, k, num_perm)
    return out


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
        p = 1 - (1 - s ** rows) ** bands
        # Riemann sums over the grid: the areas of false candidates and of missed pairs.
        cost = p[below].sum() + 4 * (1 - p[~below]).sum()  # a missed duplicate costs a generation; a candidate a compare
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
