"""Shadow verification: the measured false-hit rate of near and semantic reuse.

A sampled reused record (dedup marks it `shadow`) is generated anyway, and its output is compared
with the one it would have reused (token F1). The share that disagree, with its Wilson interval,
goes in the partition counts and the manifest's `verification` section.
"""

from __future__ import annotations

import math
import re
from collections import Counter

import pyarrow as pa

_TOKEN = re.compile(r"\w+")


def token_f1(a: str, b: str) -> float:
    """Token-level F1 of two outputs (SQuAD style, lowercased word tokens); 1.0 when both are empty."""
    ta, tb = _TOKEN.findall(a.lower()), _TOKEN.findall(b.lower())
    if not ta and not tb:
        return 1.0
    common = sum((Counter(ta) & Counter(tb)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(ta), common / len(tb)
    return 2 * precision * recall / (precision + recall)


def wilson_interval(failures: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion: sound at small n and at 0 observed failures."""
    if n == 0:
        return (0.0, 1.0)
    p = failures / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def verify_shadows(records: pa.Table, items: dict[str, dict], reference: dict[str, str], min_f1: float) -> dict:
    """Compare each shadow-verified record's own output with the one it would have reused.

    `reference` maps a key to its output text (this job's items, or the cache for earlier jobs).
    Returns counts per reuse kind and the ids of disagreements (a few, for inspection).
    """
    by_kind: dict[str, dict] = {}
    samples = []
    for id_, own, gen, kind, sim, shadow in zip(
        *(records[c].to_pylist() for c in ("id", "item_key", "gen_key", "reuse", "similarity", "shadow"))
    ):
        if not shadow or own not in items or gen not in reference:
            continue
        f1 = token_f1(reference[gen], items[own]["summary"])
        k = by_kind.setdefault(kind, {"checked": 0, "false_hits": 0})
        k["checked"] += 1
        if f1 < min_f1:
            k["false_hits"] += 1
            if len(samples) < 20:
                samples.append({"id": id_, "kind": kind, "similarity": round(sim or 0.0, 4), "f1": round(f1, 4)})
    return {"by_kind": by_kind, "false_hit_samples": samples}


def summarise_verification(parts: list[dict], min_f1: float) -> dict:
    """Partition results summed, with the false-hit rate and its 95% interval, overall and per kind."""
    by_kind: dict[str, dict] = {}
    samples: list[dict] = []
    for part in parts:
        for kind, v in part.get("by_kind", {}).items():
            k = by_kind.setdefault(kind, {"checked": 0, "false_hits": 0})
            k["checked"] += v["checked"]
            k["false_hits"] += v["false_hits"]
        samples.extend(part.get("false_hit_samples", []))

    def rate(v: dict) -> dict:
        low, high = wilson_interval(v["false_hits"], v["checked"])
        return {
            **v,
            "false_hit_rate": round(v["false_hits"] / v["checked"], 4) if v["checked"] else None,
            "ci95": [round(low, 4), round(high, 4)],
        }

    total = {
        "checked": sum(v["checked"] for v in by_kind.values()),
        "false_hits": sum(v["false_hits"] for v in by_kind.values()),
    }
    return {
        **rate(total),
        "min_f1": min_f1,
        "by_kind": {k: rate(v) for k, v in sorted(by_kind.items())},
        "false_hit_samples": samples[:20],
    }
