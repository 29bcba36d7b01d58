"""The tier worker's own Python per engine step (pipeline/generate/worker.py), with the fake engine's time apart.

On a GPU one vLLM step at `max_num_seqs` 256 takes 10-40 ms; whatever the worker does between two steps (share
the step's seconds among the requests in flight, price, check and store what finished, finish units) is time
the GPU waits. This benchmark runs the worker's loop on the deterministic fake engine (`engine: fake`, no step
time) with N requests in flight and times the loop apart from the fake engine's own calls (`add` and `step`:
drawing and tokenising answers, which a real engine does on its own side): the rest, per engine step, is the
worker's overhead. With `--step-ms`, each fake step also sleeps that long, as the main process waits on a GPU's
step (vLLM's engine runs in a process of its own): what the worker does on other threads meanwhile is off the
step path, and only what it does between steps counts.

Two ways through the worker:
- `job`: a whole job (`run_job`, SQLite catalog in memory-backed storage), so each step's overhead includes the
  catalog writes (items, key states, session renewals) and the units' next waves;
- `memory`: the same requests through generate/memory_units.py (no catalog: the loop, pricing and output checks).

The tier is configs/local.yaml's large one (SmolLM2's tokenizer, `tokenmill models real`) run by the fake engine
with `max_num_seqs` N; dedup, routing and escalation off, so every document is one request. Answers run to a
length drawn per request between 16 and `max_tokens` (96), so that requests finish at different steps and new
ones join the batch, as with a real model (the fake engine alone would finish a whole batch in the same step).

Usage: python benchmarks/worker_loop.py [--documents 2048] [--in-flight 64,256] [--modes job,memory] [--step-ms 0,20]
       [--profile]
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import emit  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def config(tmp: Path, in_flight: int, step_ms: float):
    from pipeline.config import load_config

    model = "${TOKENMILL_HOME}/models/real/smollm2-f32"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_") or k == "TOKENMILL_HOME"}
    env.update(
        {
            "TOKENMILL_INPUT__URI": str(tmp / "in"),
            "TOKENMILL_OUTPUT__URI": str(tmp / "out"),
            "TOKENMILL_STATE__URL": f"sqlite:///{tmp}/state.db",
            "TOKENMILL_CACHE__PATH": str(tmp / "cache"),
            "TOKENMILL_RUN__PROGRESS": "off",
            "TOKENMILL_DEDUP__EXACT": "false",
            "TOKENMILL_DEDUP__NEAR": "false",
            "TOKENMILL_DEDUP__SEMANTIC": "false",
            **{
                f"TOKENMILL_TIERS__{t}__{k}": v
                for t in ("SMALL", "LARGE")
                for k, v in {
                    "ENGINE": "fake",
                    "MODEL": model,
                    "VLLM__MAX_NUM_SEQS": str(in_flight),
                    "FAKE__STEP_SECONDS": str(step_ms / 1000),
                }.items()
            },
        }
    )
    return load_config(REPO / "configs" / "local.yaml", environ=env)


def documents(n: int) -> list[str]:
    from pipeline.dev.samples import synthetic_document

    rng = random.Random(7)
    return [synthetic_document(rng, rng.randint(4, 16)) + f" Reference {i}." for i in range(n)]


class Clock:
    """Seconds spent in the fake engine's calls and in the worker's loop, and the loop's engine steps."""

    def __init__(self):
        self.fake = self.loop = 0.0
        self.steps = self.advanced = 0


def instrument(clock: Clock) -> None:
    """Time the fake engine's `add` and `step` and the worker's `loop`; draw each answer's length per request."""
    import xxhash

    from pipeline.generate.fake_engine import FakeEngine
    from pipeline.generate.worker import TierWorker

    add, step, loop = FakeEngine.add, FakeEngine.step, TierWorker.loop

    @functools.wraps(add)
    def timed_add(self, request_id, prompt, max_tokens, sampling, adapter=None):
        started = time.perf_counter()
        try:  # 16 .. max_tokens, by the prompt: requests finish at different steps, as a real model's do
            length = 16 + xxhash.xxh3_64_intdigest(str(prompt[-8:]).encode()) % max(1, max_tokens - 15)
            return add(self, request_id, prompt, min(max_tokens, length), sampling, adapter)
        finally:
            clock.fake += time.perf_counter() - started

    @functools.wraps(step)
    def timed_step(self):
        started = time.perf_counter()
        try:
            out = step(self)
            clock.steps += 1
            clock.advanced += len(out)
            return out
        finally:
            clock.fake += time.perf_counter() - started

    @functools.wraps(loop)
    def timed_loop(self, steps):
        started = time.perf_counter()
        try:
            return loop(self, steps)
        finally:
            clock.loop += time.perf_counter() - started

    FakeEngine.add, FakeEngine.step, TierWorker.loop = timed_add, timed_step, timed_loop


def run(mode: str, docs: list[str], in_flight: int, step_ms: float, clock: Clock, tmp: Path) -> int:
    """One run; how many requests finished."""
    from pipeline.generate.engine import EnginePool

    c = config(tmp, in_flight, step_ms)
    if mode == "job":
        from pipeline import run_job

        (tmp / "in").mkdir()
        import json

        with open(tmp / "in" / "docs.jsonl", "w") as f:
            for i, text in enumerate(docs):
                f.write(json.dumps({"id": f"d{i}", "text": text, "tenant": f"t{i % 3}"}) + "\n")
        manifest = run_job(c, job_id="bench", pool=EnginePool(c.tiers)).manifest.as_json()
        return manifest["counts"]["outputs"]
    from pipeline.generate.memory_units import generate
    from pipeline.generate.requests import render_prompts, tokenize

    pool = EnginePool(c.tiers)
    tokenizer = pool.tokenizer("large")
    prompts = tokenize(tokenizer, render_prompts(tokenizer, docs, c.prompt))
    rows = [
        {
            "prompt_token_ids": list(p),
            "max_tokens": c.sampling.max_tokens,
            "generation": {"item_key": f"k{i}", "id": f"d{i}", "tenant": "t", "scope": "s", "text": d},
        }
        for i, (p, d) in enumerate(zip(prompts, docs))
    ]
    side, _ = generate(rows, "large", c, pool)
    return len(side.items)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=2048)
    parser.add_argument("--in-flight", default="64,256")
    parser.add_argument("--modes", default="job,memory")
    parser.add_argument("--step-ms", default="0,20", help="the fake engine's sleep per step (a GPU's step: 10-40 ms)")
    parser.add_argument("--profile", action="store_true", help="print the loop's cProfile (cumulative, top 40)")
    args = parser.parse_args()
    clock = Clock()
    instrument(clock)
    docs = documents(args.documents)
    runs = [
        (mode, float(ms), int(n))
        for ms in args.step_ms.split(",")
        for mode in args.modes.split(",")
        for n in args.in_flight.split(",")
    ]
    for mode, step_ms, n in runs:
        before = (clock.fake, clock.loop, clock.steps, clock.advanced)
        profiler = None
        if args.profile:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as tmp:
            finished = run(mode, docs, n, step_ms, clock, Path(tmp))
        if profiler is not None:
            import pstats

            profiler.disable()
            pstats.Stats(profiler, stream=sys.stderr).sort_stats("cumulative").print_stats(40)
        fake, loop = clock.fake - before[0], clock.loop - before[1]
        steps, advanced = clock.steps - before[2], clock.advanced - before[3]
        emit(
            "worker_loop",
            {
                "mode": mode,
                "max_num_seqs": n,
                "fake_step_ms": step_ms,
                "documents": len(docs),
                "finished": finished,
                "engine_steps": steps,
                "requests_per_step": round(advanced / max(steps, 1), 1),
                "loop_seconds": round(loop, 3),
                "fake_engine_seconds": round(fake, 3),
                "worker_ms_per_step": round(1000 * (loop - fake) / max(steps, 1), 3),
                "worker_us_per_request_step": round(1e6 * (loop - fake) / max(advanced, 1), 2),
                "fake_engine_ms_per_step": round(1000 * fake / max(steps, 1), 3),
            },
        )


if __name__ == "__main__":
    main()
