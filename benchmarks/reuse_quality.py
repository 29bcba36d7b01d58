"""Reuse quality and dedup throughput: what each threshold reuses, what it reuses wrongly, how fast.

1. A labelled pair set, made here from a fixed seed and clearly synthetic: report-like documents
   of about 2 KB with companies, people, places and figures, each paired with a variant that
   SHOULD reuse its summary (whitespace, boilerplate footer, forwarding header, light paraphrase)
   or MUST NOT (a negation, a changed number, a swapped entity, a different subject with the same
   opening). For every threshold it prints the reuse rate (should-pairs reused) and the false-reuse
   rate (must-not pairs reused), for near (MinHash Jaccard) and semantic (static-embedding cosine)
   matching, with and without the meaning guards. The defaults in pipeline/config/dedup.py come from it.
2. Throughput of the dedup stage on this machine, documents of about 2 KB: exact (normalise + hash),
   near (signatures + LSH + guards), semantic (embeddings + exact search + guards).

    python benchmarks/reuse_quality.py [--pairs 400] [--docs 20000]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402

from benchmarks.common import emit  # noqa: E402
from pipeline.config import DedupConfig, PromptConfig, SamplingConfig, TierConfig  # noqa: E402
from pipeline.dedup import guards, minhash  # noqa: E402
from pipeline.dedup.cluster import add_content_hashes, cluster_records  # noqa: E402
from pipeline.keys import add_item_keys, clean_text  # noqa: E402

COMPANIES = [
    "Acme Corp",
    "Globex",
    "Initech",
    "Umbrella Labs",
    "Stark Industries",
    "Wayne Logistics",
    "Hooli",
    "Vandelay Imports",
    "Soylent Foods",
    "Tyrell Systems",
    "Cyberdyne",
    "Massive Dynamic",
]
PEOPLE = [
    "Dana Smith",
    "Lee Wong",
    "Priya Patel",
    "Marco Rossi",
    "Anna Novak",
    "Tom Becker",
    "Sara Haddad",
    "Jonas Berg",
    "Maria Lopez",
    "Ken Sato",
]
PLACES = ["Ohio", "Bavaria", "Lyon", "Osaka", "Ontario", "Texas", "Gdansk", "Porto", "Nairobi", "Perth"]
TOPICS = [
    "industrial pumps",
    "cloud storage",
    "frozen foods",
    "freight services",
    "medical imaging",
    "solar panels",
    "payroll software",
    "steel tubing",
    "pet insurance",
    "data centres",
]
SENTENCES = [
    "{c} reported quarterly revenue of {n1} million dollars, compared with {n2} million a year earlier.",
    "The board approved a dividend of {n3} cents per share and a buyback programme.",
    "Chief executive {p} said demand for {t} remained strong in {l}.",
    "The company opened a new plant in {l} employing {n4} people.",
    "Operating margin was {n5} percent, helped by lower shipping costs.",
    "{p2} will lead the expansion into {l2} starting next quarter.",
    "Analysts expect growth to continue as customers move to {t}.",
    "Inventory levels were stable and delivery times improved across the region.",
    "The audit committee reviewed supplier contracts and found no material issues.",
    "Customer satisfaction scores rose for the third consecutive quarter.",
    "The firm confirmed its full-year guidance and its hiring plan for {l2}.",
    "Management said the integration of the acquired business is on schedule.",
    "Capital spending will reach {n6} million dollars, mostly on automation.",
    "Staff turnover fell and the training budget was increased.",
    "Regulators in {l} approved the new product line after a review.",
]
PARAPHRASE = {
    "reported": "posted",
    "remained": "stayed",
    "opened": "launched",
    "expect": "anticipate",
    "improved": "got better",
    "rose": "increased",
    "confirmed": "reaffirmed",
    "reviewed": "examined",
    "strong": "robust",
    "lower": "reduced",
    "said": "stated",
    "fell": "declined",
    "stable": "steady",
    "schedule": "track",
    "mostly": "chiefly",
}


def document(rng: random.Random) -> tuple[str, dict]:
    slots = {
        "c": rng.choice(COMPANIES),
        "p": rng.choice(PEOPLE),
        "p2": rng.choice(PEOPLE),
        "l": rng.choice(PLACES),
        "l2": rng.choice(PLACES),
        "t": rng.choice(TOPICS),
        **{f"n{i}": str(rng.randint(2, 999)) for i in range(1, 7)},
    }
    order = SENTENCES[:3] + rng.sample(SENTENCES[3:], 12)
    text = " ".join(s.format(**slots) for s in order)
    while len(text) < 1900:
        text += " " + rng.choice(SENTENCES[7:10]).format(**slots)
    return text, slots


def should_variant(rng: random.Random, text: str, kind: str) -> str:
    if kind == "whitespace":
        return "  " + text.replace(". ", ".\n\n", 3).replace(" ", "  ", 10) + "\n"
    if kind == "boilerplate":
        return text + " CONFIDENTIAL: this message is intended only for its recipient and may be privileged."
    if kind == "header":
        return f"Fwd: Re: quarterly update (from {rng.choice(PEOPLE)}) " + text
    words = text.split(" ")  # paraphrase: synonyms for some words
    return " ".join(PARAPHRASE.get(w, w) if rng.random() < 0.8 else w for w in words)


def must_not_variant(rng: random.Random, text: str, slots: dict, kind: str) -> str:
    if kind == "negation":
        return (
            text.replace("The board approved", "The board did not approve", 1)
            if "board approved" in text
            else text.replace(" remained strong", " did not remain strong", 1)
        )
    if kind == "number":
        return text.replace(
            f"revenue of {slots['n1']} million", f"revenue of {int(slots['n1']) + rng.randint(1, 90)} million", 1
        )
    if kind == "entity":
        other = rng.choice([c for c in COMPANIES if c != slots["c"]])
        return text.replace(slots["c"], other)
    first = text.split(". ")[0] + ". "  # different subject, same opening sentence
    other, _ = document(rng)
    return first + other.split(". ", 1)[1]


SHOULD = ("whitespace", "boilerplate", "header", "paraphrase")
MUST_NOT = ("negation", "number", "entity", "different_subject")


def labelled_pairs(n: int, seed: int = 5) -> list[tuple[str, str, str, bool]]:
    """(kind, a, b, should_reuse) pairs, half of each label."""
    rng = random.Random(seed)
    pairs = []
    for i in range(n):
        text, slots = document(rng)
        if i % 2 == 0:
            kind = SHOULD[(i // 2) % len(SHOULD)]
            pairs.append((kind, text, should_variant(rng, text, kind), True))
        else:
            kind = MUST_NOT[(i // 2) % len(MUST_NOT)]
            pairs.append((kind, text, must_not_variant(rng, text, slots, kind), False))
    return pairs


def quality(pairs, embedder, config: DedupConfig) -> dict:
    a = [clean_text(p[1]) for p in pairs]
    b = [clean_text(p[2]) for p in pairs]
    labels = np.array([p[3] for p in pairs])
    jac = np.array([minhash.jaccard(minhash.signature(x), minhash.signature(y)) for x, y in zip(a, b)])
    cos = np.sum(embedder.encode(a) * embedder.encode(b), axis=1) if embedder is not None else None
    guard_ok = np.array([guards.texts_agree(x, y, config.max_length_ratio) is None for x, y in zip(a, b)])

    def rates(scores, thresholds):
        rows = []
        for t in thresholds:
            hit = scores >= t
            for guarded in (False, True):
                h = hit & guard_ok if guarded else hit
                rows.append(
                    {
                        "threshold": t,
                        "guards": guarded,
                        "reuse_rate": round(float(h[labels].mean()), 4),
                        "false_reuse_rate": round(float(h[~labels].mean()), 4),
                    }
                )
        return rows

    out = {"pairs": len(pairs), "near": rates(jac, [0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95])}
    if cos is not None:
        out["semantic"] = rates(cos, [0.8, 0.85, 0.9, 0.92, 0.95, 0.97, 0.99])
    kinds = {}
    for kind in SHOULD + MUST_NOT:
        idx = [i for i, p in enumerate(pairs) if p[0] == kind]
        kinds[kind] = {
            "jaccard_median": round(float(np.median(jac[idx])), 3),
            "cosine_median": round(float(np.median(cos[idx])), 3) if cos is not None else None,
            "guards_pass": round(float(guard_ok[idx].mean()), 3),
        }
    out["by_kind"] = kinds
    return out


def keyed(texts: list[str], config: DedupConfig) -> pa.Table:
    n = len(texts)
    table = pa.table(
        {
            "id": [f"d{i}" for i in range(n)],
            "tenant": ["t"] * n,
            "text": texts,
            "partition": ["p"] * n,
            "tier": ["small"] * n,
        }
    )
    table = add_content_hashes(table, config)
    return add_item_keys(
        table, PromptConfig(), SamplingConfig(), {"small": TierConfig(model="m", price_per_gpu_hour=1)}
    )


def throughput(n: int, embedder) -> dict:
    rng = random.Random(9)
    base = [document(rng)[0] for _ in range(n * 7 // 10)]
    texts = base + [should_variant(rng, rng.choice(base), "header") for _ in range(n - len(base))]  # 30% near copies
    rng.shuffle(texts)
    size = sum(len(t.encode()) for t in texts) / n
    out = {"documents": n, "mean_bytes": round(size)}

    config = DedupConfig(near=False, shadow_rate=0.0)
    started = time.perf_counter()
    add_content_hashes(pa.table({"id": [f"d{i}" for i in range(n)], "tenant": ["t"] * n, "text": texts}), config)
    out["exact_docs_per_s"] = round(n / (time.perf_counter() - started))

    table = keyed(texts, config)
    started = time.perf_counter()
    _, stats = cluster_records(table, DedupConfig(near=True, shadow_rate=0.0))
    out["near_docs_per_s"] = round(n / (time.perf_counter() - started))
    out["near_reused"] = stats.clusters.get("near_duplicate", 0)

    if embedder is not None:
        started = time.perf_counter()
        _, stats = cluster_records(table, DedupConfig(near=False, semantic=True, shadow_rate=0.0), embedder)
        out["semantic_docs_per_s"] = round(n / (time.perf_counter() - started))
        out["semantic_reused"] = stats.clusters.get("semantic", 0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=400)
    parser.add_argument("--docs", type=int, default=20_000)
    parser.add_argument(
        "--embedder", default=None, help="static embedder folder (default: $TOKENMILL_HOME/models/static-minilm)"
    )
    args = parser.parse_args()
    from pipeline.config import tokenmill_home
    from pipeline.dedup.embed import EmbedderError, StaticEmbedder

    try:
        embedder = StaticEmbedder(args.embedder or tokenmill_home() / "models" / "static-minilm")
    except EmbedderError as e:
        print(f"semantic figures skipped: {e}", file=sys.stderr)
        embedder = None
    emit(
        "reuse_quality",
        {
            "quality": quality(labelled_pairs(args.pairs), embedder, DedupConfig()),
            "throughput": throughput(args.docs, embedder),
        },
    )


if __name__ == "__main__":
    main()
