"""Planning at scale: documents/s and peak memory of a job's planning (read, validate, exact / near /
semantic dedup, route, stage; pipeline/plan/streamed.py) by corpus size and number of planning processes.

No engine: planning ends before the first GPU request. Each run is its own process, so its peak RSS
(getrusage: the planning process, and the largest of its pool workers) is its own. The corpus is
synthetic but shaped like a nightly multi-tenant batch: about 2 KB report-like documents over 8 tenants,
about 15% exact copies, 10% near copies (a sentence added) and 5% reordered copies (semantic
neighbours), in JSONL files of 10,000. With `--reference`, the job is also planned in one shard with
nothing cut (one process holding every record), and each run's staged reuse is compared with it row
by row: shards of whole scopes must miss nothing; a scope cut in parts (`--shard-rows`, below its
records) may miss semantic matches across parts, which are counted. Also printed: the recall of the
semantic search's IVF index against the exact search, on one scope's embeddings, where the scope is
large enough to use it.

Targets: peak RSS <= 2 GB per planning process at 1 M documents; >= 2,000 docs/s on 2
cores at 100 k. Usage: python benchmarks/planning_scale.py [--documents 20000,100000] [--workers 1,2]
[--tenants 8] [--shard-rows 200000] [--reference] (`--documents 1000000` for the note: about 2 GB of
input written to a temporary folder; `--tenants 1` for one huge tenant, cut in parts of
`--shard-rows`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))

PER_FILE = 10_000
TENANTS = 8


def write_corpus(folder: Path, documents: int, seed: int = 19, tenants: int = TENANTS) -> int:
    """JSONL files of PER_FILE documents; returns the bytes written."""
    from pipeline.dev.samples import synthetic_document

    rng = random.Random(seed)
    sentences = [
        s.strip() + "." for d in (synthetic_document(rng, 40) for _ in range(2000)) for s in d.split(".") if s.strip()
    ]
    plain = [s for s in sentences if not any(c.isdigit() for c in s)]  # added to near copies: no new number
    folder.mkdir(parents=True, exist_ok=True)
    recent: list[tuple[str, str]] = []  # (tenant, text) of recent documents, for copies
    size = 0
    out = None
    for i in range(documents):
        if i % PER_FILE == 0:
            if out:
                out.close()
            out = open(folder / f"part-{i // PER_FILE:05d}.jsonl", "w", encoding="utf-8")
        roll = rng.random()
        if recent and roll < 0.30:
            tenant, text = recent[rng.randrange(len(recent))]
            if roll < 0.15:
                pass  # an exact copy
            elif roll < 0.25:
                text = text + " " + rng.choice(plain)  # a near copy: a sentence added
            else:
                parts = text.split(". ")
                rng.shuffle(parts)  # a reordered copy: same words, other order
                text = ". ".join(parts)
        else:
            tenant = f"tenant-{rng.randrange(tenants)}"
            text = " ".join(rng.choice(sentences) for _ in range(rng.randint(19, 27)))  # about 2 KB
        recent.append((tenant, text))
        if len(recent) > 5000:
            recent.pop(rng.randrange(len(recent)))
        line = json.dumps({"id": f"d{i}", "text": text, "tenant": tenant}) + "\n"
        size += len(line)
        out.write(line)
    if out:
        out.close()
    return size


def child(input_dir: str, workers: int, tmp: str, shard_rows: int) -> None:
    """One planning run, in this process: print its figures as one JSON line; its staged reuse decisions
    go to `<tmp>/decisions.parquet`, for the parent to compare runs."""
    from pipeline.config import load_config
    from pipeline.plan.streamed import plan_job
    from pipeline.stores import storage
    from pipeline.stores.staging import StagingArea

    config = load_config(
        ROOT / "configs" / "tiny.yaml",
        environ={
            "TOKENMILL_INPUT__URI": input_dir,
            "TOKENMILL_OUTPUT__URI": f"{tmp}/out",
            "TOKENMILL_CACHE__PATH": f"{tmp}/cache",
            "TOKENMILL_DEDUP__SHADOW_RATE": "0",
            "TOKENMILL_PLANNING__SHARD_ROWS": str(shard_rows),
            **{k: v for k, v in os.environ.items() if k == "TOKENMILL_HOME"},
        },
    )
    area = StagingArea(storage.resolve(f"{tmp}/out"), "bench")
    started = time.perf_counter()
    plan = plan_job(config, "bench", area, workers=workers)
    seconds = time.perf_counter() - started
    import pyarrow as pa
    import pyarrow.parquet as pq

    decisions = pa.concat_tables([area.records(p, columns=["id", "gen_key", "reuse"]) for p in plan.partitions])
    pq.write_table(decisions.sort_by("id"), f"{tmp}/decisions.parquet")
    rss_self = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rss_workers = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    reused = plan.dedup.as_dict()["reused"]
    print(
        json.dumps(
            {
                "seconds": seconds,
                "records": plan.records,
                "shards": plan.shards,
                "peak_rss_planner": rss_self,
                "peak_rss_worker": rss_workers,
                "reused": reused,
                "step_seconds": {k: round(v, 2) for k, v in plan.seconds.items()},
                "cut": {scope: len(rows) for scope, rows in plan.cut.items()},
                "partitions": len(plan.partitions),
            }
        )
    )


def misses(run: str, reference: str) -> dict:
    """Rows whose staged reuse differs from the reference run's, and how many of those the reference reused
    semantically (what a cut scope can miss) or near / exact (what no sharding may miss)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    a, b = pq.read_table(f"{run}/decisions.parquet"), pq.read_table(f"{reference}/decisions.parquet")
    differ = pc.invert(
        pc.and_(
            pc.equal(a["gen_key"], b["gen_key"]), pc.equal(pc.fill_null(a["reuse"], ""), pc.fill_null(b["reuse"], ""))
        )
    )
    kinds = pc.value_counts(pc.fill_null(b["reuse"].filter(differ), "none")).to_pylist()
    return {
        "rows": pc.sum(differ).as_py() or 0,
        "by_reference_reuse": {k["values"]: k["counts"] for k in kinds},
        "reference_semantic": pc.sum(pc.equal(b["reuse"], "semantic")).as_py() or 0,
    }


def semantic_recall(input_dir: str, documents: int) -> dict:
    """Recall of the IVF search against the exact one, on one tenant's embeddings (first rows of keys)."""
    from pipeline.config import load_config
    from pipeline.dedup import neighbours
    from pipeline.dedup.embed import StaticEmbedder

    config = load_config(
        ROOT / "configs" / "tiny.yaml", environ={k: v for k, v in os.environ.items() if k == "TOKENMILL_HOME"}
    )
    texts = []
    for f in sorted(Path(input_dir).iterdir()):
        for line in f.open():
            rec = json.loads(line)
            if rec["tenant"] == "tenant-0":
                texts.append(rec["text"])
    texts = list(dict.fromkeys(texts))
    vectors = StaticEmbedder(config.dedup.embedder).encode(texts).astype("float16")
    return {
        "scope_rows": len(vectors),
        "uses_ivf": len(vectors) > 20_000,
        "recall_vs_exact": round(neighbours.recall(vectors, config.dedup.semantic_threshold), 4)
        if len(vectors) > 1000
        else None,
    }


def main() -> None:
    from benchmarks.common import emit

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--documents", default="20000,100000")
    parser.add_argument("--workers", default="1,2")
    parser.add_argument(
        "--tenants",
        type=int,
        default=TENANTS,
        help="tenants the documents are spread over (1: one scope, so one shard, whatever the workers)",
    )
    parser.add_argument(
        "--shard-rows",
        type=int,
        default=200_000,
        help="planning.shard_rows: a tenant with more records is cut into parts",
    )
    parser.add_argument(
        "--reference",
        action="store_true",
        help="also plan in one shard, nothing cut (one process holds every record), and count "
        "the rows each run stages differently: the misses of sharding and cutting",
    )
    parser.add_argument("--child", nargs=4, metavar=("INPUT", "WORKERS", "TMP", "SHARD_ROWS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child[0], int(args.child[1]), args.child[2], int(args.child[3]))
    for documents in [int(d) for d in args.documents.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            size = write_corpus(Path(tmp) / "in", documents, tenants=args.tenants)
            runs = {}
            plans = [(w, args.shard_rows) for w in (int(w) for w in args.workers.split(","))]
            for workers, shard_rows in plans + ([(1, 10**12)] if args.reference else []):
                out = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--child",
                        f"{tmp}/in",
                        str(workers),
                        f"{tmp}/w{workers}-{shard_rows}",
                        str(shard_rows),
                    ],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                runs[workers, shard_rows] = json.loads(out.stdout.strip().splitlines()[-1])
            figures = {
                "documents": documents,
                "tenants": args.tenants,
                "input_mb": round(size / 1e6, 1),
                "cores": len(os.sched_getaffinity(0)),
            }
            for (workers, shard_rows), r in runs.items():
                peak = max(r["peak_rss_planner"], r["peak_rss_worker"])
                name = f"workers={workers}" + (", one shard (reference)" if shard_rows == 10**12 else "")
                figures[name] = {
                    "docs_per_second": round(documents / r["seconds"]),
                    "seconds": round(r["seconds"], 1),
                    "shards": r["shards"],
                    "cut_scopes": r["cut"],
                    "step_seconds": r["step_seconds"],
                    "peak_rss_mb_planner": round(r["peak_rss_planner"] / 2**20),
                    "peak_rss_mb_largest_worker": round(r["peak_rss_worker"] / 2**20),
                    "peak_rss_bytes_per_document": round(peak / documents),
                    "reused": r["reused"],
                    # Against one shard with nothing cut: whole scopes miss nothing; cut ones, semantic pairs.
                    "misses_vs_one_shard": misses(f"{tmp}/w{workers}-{shard_rows}", f"{tmp}/w1-{10**12}")
                    if args.reference and shard_rows != 10**12
                    else "not compared (run with --reference)",
                }
            one = {w: r for (w, rows), r in runs.items() if rows == args.shard_rows}
            if 2 in one and 1 in one:
                figures["speedup_2_vs_1"] = round(one[1]["seconds"] / one[2]["seconds"], 2)
            figures["semantic_ivf"] = semantic_recall(f"{tmp}/in", documents)
            figures["targets"] = {"peak_rss_mb_at_1M": 2048, "docs_per_second_2_cores_at_100k": 2000}
            emit("planning_scale", figures)


if __name__ == "__main__":
    main()
