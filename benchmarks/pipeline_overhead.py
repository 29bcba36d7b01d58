"""Pipeline overhead: documents per second through every stage except inference.

Inference is the deterministic fake engine (`engine: fake`, pipeline/generate/fake_engine.py: 16-token
answers, no step time, a batch as large as the engine calls), so what is timed is read, validate, dedup, route,
building requests (chat template + tokenisation), the paid-items lookup
and store, cost attribution and the Parquet writes. Target: >= 5,000 docs/s on 2 cores, so the
non-inference path never starves a GPU. Also printed: the dedup stage's own seconds, and how fast
the same prompts are tokenised with nothing else running, the ceiling exact tokenisation sets on
this machine.

Many small files (issue 30): planning alone over folders of FILES one-document .txt files (20,000 and
200,000 by default), packed into partitions of `input.records_per_partition`: docs/s for each size (linear
in the records when the two are close), the partitions they make and the seconds per planning step.

Usage: python benchmarks/pipeline_overhead.py [DOCS] [--small-files 20000,200000] [--skip-end-to-end]
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import time
from pathlib import Path


def tiny_config(tmp: Path, records_per_partition: int):
    """configs/tiny.yaml with the fake engine (16-token answers, no step time) and everything under `tmp`."""
    import os

    from pipeline.config import load_config

    return load_config(
        Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml",
        environ={
            "TOKENMILL_INPUT__URI": str(tmp / "in"),
            "TOKENMILL_OUTPUT__URI": str(tmp / "out"),
            "TOKENMILL_STATE__URL": f"sqlite:///{tmp}/state.db",
            "TOKENMILL_RUN__PROGRESS": "off",
            "TOKENMILL_CACHE__PATH": str(tmp / "cache"),
            "TOKENMILL_INPUT__RECORDS_PER_PARTITION": str(records_per_partition),
            **{
                f"TOKENMILL_TIERS__{t}__{k}": v
                for t in ("SMALL", "LARGE")
                for k, v in {"ENGINE": "fake", "FAKE__OUTPUT_TOKENS": "16", "VLLM__MAX_NUM_SEQS": "4096"}.items()
            },
            **{k: v for k, v in os.environ.items() if k == "TOKENMILL_HOME"},
        },
    )


def end_to_end(docs: int) -> None:
    from pipeline import run_job
    from pipeline.dev.samples import synthetic_document
    from pipeline.generate.engine_api import load_tokenizer
    from pipeline.generate.requests import render_prompts, tokenize

    rng = random.Random(5)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "in").mkdir()
        pool_of_texts = [synthetic_document(rng, 22) for _ in range(2000)]  # ~2 KB each
        per_file = 10_000
        n = 0
        for f in range(0, docs, per_file):
            with open(tmp / "in" / f"part-{f // per_file:03d}.jsonl", "w") as out:
                for i in range(f, min(docs, f + per_file)):
                    text = pool_of_texts[i % len(pool_of_texts)] + f" Reference {i}."
                    out.write(json.dumps({"id": f"d{i}", "text": text, "tenant": f"t{i % 3}"}) + "\n")
                    n += 1
        size = sum(p.stat().st_size for p in (tmp / "in").iterdir())
        config = tiny_config(tmp, per_file)
        started = time.perf_counter()
        manifest = run_job(config, job_id="bench").manifest
        seconds = time.perf_counter() - started
        staging_s = manifest["staging"]["seconds"]
        part_s = sum(p["seconds"] or 0 for p in manifest["partitions"].values())
        # The ceiling set by exact prompt tokenisation: the same prompts rendered and tokenised alone.
        tier = config.largest_tier
        tokenizer = load_tokenizer(config.tiers[tier].model)
        sample = [pool_of_texts[i % len(pool_of_texts)] + f" Reference {i}." for i in range(min(n, 20_000))]
        started = time.perf_counter()
        tokenize(tokenizer, render_prompts(tokenizer, sample, config.prompt))
        tokenise_rate = len(sample) / (time.perf_counter() - started)
        emit(
            "pipeline_overhead",
            {
                "engine": "fake (no inference)",
                "documents": n,
                "input_mb": round(size / 1e6, 1),
                "seconds": round(seconds, 2),
                "docs_per_second": round(n / seconds),
                "target_docs_per_second": 5000,
                "staging_seconds (read, validate, dedup, route, write staged partitions)": staging_s,
                "partition_seconds (lookup, tokenise, store, price, write)": round(part_s, 2),
                "dedup_seconds": manifest["staging"]["dedup"]["seconds"],
                f"tokenisation_alone_docs_per_second (tier {tier}'s tokenizer, chat template included)": round(
                    tokenise_rate
                ),
                "outputs": manifest["counts"]["outputs"],
            },
        )


def small_files(files: int, records_per_partition: int = 10_000) -> dict:
    """Plan a folder of `files` one-document .txt files (about 1 KB each, a third of them duplicates)."""
    from pipeline.dev.samples import synthetic_document
    from pipeline.plan.streamed import plan_job
    from pipeline.stores import storage
    from pipeline.stores.staging import StagingArea

    rng = random.Random(7)
    texts = [synthetic_document(rng, 10) for _ in range(2000)]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for i in range(files):
            folder = tmp / "in" / f"{i // 1000:04d}"  # 1,000 files a folder, as exports often are
            if i % 1000 == 0:
                folder.mkdir(parents=True)
            (folder / f"doc-{i:06d}.txt").write_text(texts[i % len(texts)] + (f" Ref {i}." if i % 3 else ""))
        config = tiny_config(tmp, records_per_partition)
        staging = StagingArea(storage.resolve(str(tmp / "staging")), "bench")
        started = time.perf_counter()
        plan = plan_job(config, "bench", staging)
        seconds = time.perf_counter() - started
    return {
        "files": files,
        "records": plan.records,
        "partitions": len(plan.partitions),
        "seconds": round(seconds, 2),
        "docs_per_second": round(plan.records / seconds),
        "step_seconds": {k: round(v, 2) for k, v in plan.seconds.items()},
    }


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.common import emit

    args = sys.argv[1:]
    sizes = [20_000, 200_000]
    if "--small-files" in args:
        i = args.index("--small-files")
        sizes = [int(n) for n in args[i + 1].split(",")]
        del args[i : i + 2]
    skip = "--skip-end-to-end" in args
    args = [a for a in args if a != "--skip-end-to-end"]
    if not skip:
        end_to_end(int(args[0]) if args else 100_000)
    cases = [small_files(n) for n in sizes]
    emit(
        "pipeline_overhead_small_files",
        {
            "what": "planning alone (read, validate, key, dedup, stage) over one-document .txt files, packed",
            "records_per_partition": 10_000,
            "cases": cases,
        },
    )
