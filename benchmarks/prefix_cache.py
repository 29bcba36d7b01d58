"""Prefix cache: prompt tokens served from vLLM's prefix cache, with and without prefix-aware ordering.

Corpus (fixed seed, synthetic): 240 documents, each one of 8 long shared preambles (a policy text of
about 400 tokens, the kind of boilerplate a template or few-shot block adds) followed by a short
unique body, shuffled. The same requests run twice on the real engine (tiny small model, CPU), in
engine calls of 16 items, with fresh engines each time: once in input order, once sorted by token
ids (tokenmill's default). Printed: cached prompt tokens ÷ prompt tokens for each, next to the share
that sharing allows in theory (each prompt's common prefix with its neighbour in sorted order).
Target: ordered reaches >= 90% of the theoretical share. Usage: python benchmarks/prefix_cache.py
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import os

    from benchmarks.common import emit
    from pipeline import run_job
    from pipeline.config import load_config
    from pipeline.dev.samples import synthetic_document
    from pipeline.generate.engine import shutdown_engines

    rng = random.Random(23)
    preambles = [f"Policy {k}. " + synthetic_document(rng, 28) for k in range(8)]
    docs = [
        {"id": f"d{i}", "tenant": "acme", "text": rng.choice(preambles) + " " + synthetic_document(rng, 3)}
        for i in range(240)
    ]
    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "in").mkdir()
        (tmp / "in" / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
        for name, ordering in (("input order", "false"), ("prefix-aware order", "true")):
            work = tmp / name.replace(" ", "-")
            work.mkdir()
            config = load_config(
                Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml",
                environ={
                    **{k: v for k, v in os.environ.items() if k == "TOKENMILL_HOME"},
                    "TOKENMILL_INPUT__URI": str(tmp / "in"),
                    "TOKENMILL_OUTPUT__URI": str(work / "out"),
                    "TOKENMILL_STATE__URL": f"sqlite:///{work}/state.db",
                    "TOKENMILL_CACHE__ENABLED": "false",
                    "TOKENMILL_RUN__PROGRESS": "off",
                    "TOKENMILL_ROUTE__RULES": "[]",
                    "TOKENMILL_ROUTE__ESCALATION__ENABLED": "false",
                    "TOKENMILL_DEDUP__NEAR": "false",
                    "TOKENMILL_DEDUP__SEMANTIC": "false",
                    "TOKENMILL_REQUESTS__PREFIX_ORDERING": ordering,
                },
            )
            m = run_job(config, job_id="prefix").manifest.as_json()
            shutdown_engines()  # a fresh engine (and an empty prefix cache) for the next run
            figures[name] = {
                **m["prefix_cache"],
                "prompt_tokens": m["tokens"]["prompt_tokens"],
                "cached_prompt_tokens": m["tokens"]["cached_prompt_tokens"],
            }
    emit(
        "prefix_cache",
        {
            "engine": "tiny small model on the CPU (vLLM block size 128 here: hits come in 128s)",
            "documents": len(docs),
            "runs": figures,
            "target": "prefix-aware order reaches >= 90% of the shareable share",
        },
    )
