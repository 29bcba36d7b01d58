"""Pipeline overhead: documents per second through every stage except inference.

Inference is the deterministic fake engine (`engine: fake`, pipeline/generate/fake_engine.py: 16-token
answers, no step time, a batch as large as the engine calls), so what is timed is read, validate, dedup, route,
building requests (chat template + tokenisation), the paid-items lookup
and store, cost attribution and the Parquet writes. Target: >= 5,000 docs/s on 2 cores, so the
non-inference path never starves a GPU. Also printed: the dedup stage's own seconds, and how fast
the same prompts are tokenised with nothing else running, the ceiling exact tokenisation sets on
this machine. Usage: python benchmarks/pipeline_overhead.py [DOCS]
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.common import emit
    from pipeline import run_job
    from pipeline.config import load_config
    from pipeline.dev.samples import synthetic_document
    from pipeline.generate.engine_api import load_tokenizer
    from pipeline.generate.requests import render_prompts, tokenize

    docs = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
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
        config = load_config(
            Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml",
            environ={
                "TOKENMILL_INPUT__URI": str(tmp / "in"),
                "TOKENMILL_OUTPUT__URI": str(tmp / "out"),
                "TOKENMILL_STATE__URL": f"sqlite:///{tmp}/state.db",
                "TOKENMILL_RUN__PROGRESS": "off",
                "TOKENMILL_CACHE__PATH": str(tmp / "cache"),
                "TOKENMILL_INPUT__RECORDS_PER_PARTITION": str(per_file),
                **{
                    f"TOKENMILL_TIERS__{t}__{k}": v
                    for t in ("SMALL", "LARGE")
                    for k, v in {"ENGINE": "fake", "FAKE__OUTPUT_TOKENS": "16", "VLLM__MAX_NUM_SEQS": "4096"}.items()
                },
                **{k: v for k, v in __import__("os").environ.items() if k == "TOKENMILL_HOME"},
            },
        )
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
