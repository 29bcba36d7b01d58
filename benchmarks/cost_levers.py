"""Cost levers, side by side on the real engine: what each one saves on one reference corpus.

The corpus (made here, fixed seed, clearly synthetic): report-like documents sharing one prompt
template, about 30% of them exact or near copies (a forwarding header), a third "hard" (flagged
for the large tier by a rule). The same corpus runs through tokenmill several times, each run
turning one more lever on, every run with a fresh cache and catalog:

  all off      no dedup, no cache, every item on the large tier, small engine calls (16 items)
  + reuse      exact + near + semantic dedup inside the job
  + routing    rules send easy documents to the small tier
  + batching   large engine calls (continuous batching sees the whole partition)
  next night   everything on, the same corpus again: the cache serves it

It prints one JSON line: each run's ledger dollars, GPU-seconds and sources, and the ratio of all-off
to everything-on. Engine: the tiny random-weight CPU models, so the dollars are illustrative; the
ratios are what the levers do. Usage: python benchmarks/cost_levers.py [DOCS]
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
    from benchmarks.reuse_quality import document, should_variant
    from pipeline import run_job
    from pipeline.config import load_config
    from pipeline.generate.engine import EnginePool
    from pipeline.generate.worker import forget_idle_between_jobs

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    rng = random.Random(17)
    base = []
    for i in range(int(n * 0.7)):
        text = document(rng)[0][:900]  # about 250 tokens: fits both tiny tiers with room to spare
        if i % 3 == 0:
            text = "AUDIT REVIEW. " + text  # hard: the rule sends these to the large tier
        base.append(text)
    docs = [{"id": f"d{i}", "tenant": "acme", "text": t} for i, t in enumerate(base)]
    while len(docs) < n:
        src = rng.choice(base)
        text = src if rng.random() < 0.5 else should_variant(rng, src, "header")
        docs.append({"id": f"d{len(docs)}", "tenant": "acme", "text": text})
    rng.shuffle(docs)

    off = {
        "DEDUP__EXACT": "false",
        "DEDUP__NEAR": "false",
        "DEDUP__SEMANTIC": "false",
        "CACHE__ENABLED": "false",
        "ROUTE__DEFAULT_TIER": "large",
        "ROUTE__RULES": "[]",
        "ROUTE__ESCALATION__ENABLED": "false",
        "DEDUP__SHADOW_RATE": "0",
    }
    rule = json.dumps([{"name": "audit", "tier": "large", "regex": "^AUDIT REVIEW"}])
    steps = [
        ("all off", off),
        ("+ reuse", {**off, "DEDUP__EXACT": "true", "DEDUP__NEAR": "true", "DEDUP__SEMANTIC": "true"}),
        (
            "+ routing",
            {
                **off,
                "DEDUP__EXACT": "true",
                "DEDUP__NEAR": "true",
                "DEDUP__SEMANTIC": "true",
                "ROUTE__DEFAULT_TIER": "small",
                "ROUTE__RULES": rule,
            },
        ),
        (
            "+ batching",
            {
                **off,
                "DEDUP__EXACT": "true",
                "DEDUP__NEAR": "true",
                "DEDUP__SEMANTIC": "true",
                "ROUTE__DEFAULT_TIER": "small",
                "ROUTE__RULES": rule,
                "CACHE__ENABLED": "true",
            },
        ),
    ]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "in").mkdir()
        (tmp / "in" / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
        home = {k: v for k, v in os.environ.items() if k == "TOKENMILL_HOME"}

        def run(name: str, env: dict, job: str, work: str) -> dict:
            config = load_config(
                Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml",
                environ={
                    **home,
                    "TOKENMILL_INPUT__URI": str(tmp / "in"),
                    "TOKENMILL_OUTPUT__URI": str(tmp / work / "out"),
                    "TOKENMILL_STATE__URL": f"sqlite:///{tmp / work}/state.db",
                    "TOKENMILL_CACHE__PATH": str(tmp / work / "cache"),
                    "TOKENMILL_RUN__PROGRESS": "off",
                    **{f"TOKENMILL_{k}": v for k, v in env.items()},
                },
            )
            (tmp / work).mkdir(exist_ok=True)
            # Engines live on across runs in this process, and so would their KV blocks: a run after
            # another over the same corpus would find its prompts already in vLLM's prefix cache.
            EnginePool(config.tiers).reset_prefix_caches()
            forget_idle_between_jobs()  # the gap since the last run is this benchmark's set-up, not the run's
            m = run_job(config, job_id=job).manifest.as_json()
            return {
                "cost_usd": m["cost"]["cost_usd"],
                "gpu_seconds": m["cost"]["gpu_seconds"],
                "baseline_cost_usd": m["cost"]["baseline_cost_usd"],
                "by_source": m["counts"]["by_source"],
                "by_tier": m["counts"]["by_tier"],
                "engine_starts": sum(e.get("starts", 0) for e in m["engines"].values()),
                "overhead_gpu_seconds": m["cost"]["overhead_gpu_seconds"],
            }

        # Warm-up, not measured: an engine's first calls on a CPU are slower (allocator, kernel caches).
        (tmp / "warm").mkdir()
        (tmp / "warm" / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs[:48]))
        for i, env in enumerate((steps[0][1], steps[-1][1])):
            run("warm-up", {**env, "INPUT__URI": str(tmp / "warm")}, f"warm-{i}", f"warm-{i}")
        for i, (name, env) in enumerate(steps):
            results[name] = run(name, env, f"levers-{i}", f"run{i}")
        results["next night"] = run("next night", steps[-1][1], "levers-next", f"run{len(steps) - 1}")
    first, last = results["all off"]["cost_usd"], results["+ batching"]["cost_usd"]
    emit(
        "cost_levers",
        {
            "engine": "tiny random-weight models on the CPU (small: 1.1 M params at $0.50/h, large: 5.5 M at $2.00/h)",
            "documents": len(docs),
            "runs": results,
            "all_off_over_all_on": round(first / last, 2) if last else None,
            "all_off_over_next_night": round(first / results["next night"]["cost_usd"], 2)
            if results["next night"]["cost_usd"]
            else "next night cost $0",
            "target": "everything on >= 10x cheaper than everything off",
        },
    )
