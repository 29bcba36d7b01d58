"""Near and semantic reuse scored on real outputs: how often a reused summary is wrong for its document.

The hold-out set's variants carry labels (`should_reuse`: a benign edit such as a mirror header or a
footer; false: a changed number, a swapped name, a negation, another document with the same
opening). The job's own dedup stage decides what it would reuse, and the reused summary is the
representative's large-tier output. A reuse is a false hit when the record was
labelled must-not-reuse, or when the reused summary states numbers, dates or names that the
record's document lacks and its source document has (the reuse made it unfaithful). Agreement
(ROUGE-L of the reused summary with the record's own, for the reuses regenerated as shadows) is
reported beside it: greedy decoding drifts on any edit, so low agreement alone is not an error.
"""

from __future__ import annotations

import pyarrow as pa

from pipeline.evals.runs import TierRun
from pipeline.generate.quality import rouge_l, unfaithful_terms
from pipeline.generate.shadow import wilson_interval

MEASURED = ("near_duplicate", "semantic")


def reuse_quality(records: pa.Table, labels: dict[str, dict], large: TierRun) -> dict:
    """Per reuse kind: reuses, false hits with a 95% Wilson interval, mean agreement, and the labelled
    pairs' recall (should-reuse variants reused) and refusals (must-not variants not reused)."""
    text = dict(zip(records["id"].to_pylist(), records["text"].to_pylist()))
    kinds: dict[str, dict] = {k: {"reused": 0, "false_hits": 0, "agreement": []} for k in MEASURED}
    samples = []
    for id_, kind, source, similarity in zip(
        *(records[c].to_pylist() for c in ("id", "reuse", "gen_id", "similarity"))
    ):
        if kind not in MEASURED or source not in large.summary:
            continue
        reused, label = large.summary[source], labels.get(id_, {})
        introduced = sorted(set(unfaithful_terms(reused, text[id_])) - set(unfaithful_terms(reused, text[source])))
        wrong = label.get("should_reuse") is False or bool(introduced)
        k = kinds[kind]
        k["reused"] += 1
        k["false_hits"] += wrong
        if id_ in large.summary:  # a shadow regeneration of this record exists
            k["agreement"].append(rouge_l(reused, large.summary[id_]))
        if wrong and len(samples) < 20:
            samples.append(
                {
                    "id": id_,
                    "source": source,
                    "kind": kind,
                    "variant": label.get("variant"),
                    "similarity": round(similarity or 0.0, 4),
                    "introduced": introduced[:5],
                }
            )
    out = {kind: summary(k) for kind, k in kinds.items()}
    total = {
        "reused": sum(k["reused"] for k in kinds.values()),
        "false_hits": sum(k["false_hits"] for k in kinds.values()),
        "agreement": [a for k in kinds.values() for a in k["agreement"]],
    }
    return {
        "by_kind": out,
        "total": summary(total),
        "labelled": labelled_pairs(records, labels),
        "false_hit_samples": samples,
    }


def summary(k: dict) -> dict:
    low, high = wilson_interval(k["false_hits"], k["reused"])
    agreement = k["agreement"]
    return {
        "reused": k["reused"],
        "false_hits": k["false_hits"],
        "false_hit_rate": round(k["false_hits"] / k["reused"], 4) if k["reused"] else None,
        "ci95": [round(low, 4), round(high, 4)],
        "mean_agreement": round(sum(agreement) / len(agreement), 4) if agreement else None,
    }


def labelled_pairs(records: pa.Table, labels: dict[str, dict]) -> dict:
    """What dedup did with each labelled variant: reused (near, semantic, or exact: the same item key
    as the document it varies) or generated on its own."""
    key = dict(zip(records["id"].to_pylist(), records["item_key"].to_pylist()))
    out = {"should_reuse": {"pairs": 0, "reused": 0}, "must_not_reuse": {"pairs": 0, "reused": 0}}
    for id_, kind in zip(records["id"].to_pylist(), records["reuse"].to_pylist()):
        label = labels.get(id_)
        if not label or "should_reuse" not in label:
            continue
        bucket = out["should_reuse" if label["should_reuse"] else "must_not_reuse"]
        bucket["pairs"] += 1
        bucket["reused"] += int(kind is not None or key[id_] == key.get(label.get("variant_of")))
    for bucket in out.values():
        bucket["share_reused"] = round(bucket["reused"] / bucket["pairs"], 4) if bucket["pairs"] else None
    return out
