"""Pipeline overhead: documents per second through every stage except inference.

Inference is the deterministic fake engine (`engine: fake`, pipeline/generate/fake_engine.py: 16-token
answers, no step time, a batch as large as the engine calls), so what is timed is read, validate, dedup, route,
building requests (chat template + tokenisation), the paid-items lookup
and store, cost attribution and the Parquet writes. Target: >= 5,000 docs/s on 2 cores, so the
non-inference path never starves a GPU. Also printed: the dedup stage's own seconds, and how fast
the same prompts are tokenised with nothing else running, the ceiling exact tokenisation sets on
this machine.

Many small files: planning alone over folders of FILES one-document .txt files (20,000 and
200,000 by default), packed into partitions of `input.records_per_partition`: docs/s for each size (linear
in the records when the two are close), the partitions they make and the seconds per planning step.

The CPU side scaled out: the same corpus run as an orchestrator runs it, each step's tasks
(pipeline/job/orchestrate.py) on a pool of N processes, as Airflow's mapped tasks on N CPU slots: `prepare`
per partition, N `drain` tasks per tier (as `run.tier_workers: N` would run them: N tier workers of the fake
engine sharing the tier's units, the escalation tier's after the others', as N GPU hosts with a CPU each),
`commit` per partition. Planning runs first in the parent with its own processes
(`planning.workers`). The pool's processes are started and warm before the clock starts and live across
tasks, so an Airflow task's start-up (seconds each) is not counted. Printed per N: each step's seconds, each tier
worker's units, requests and seconds, and docs/s end to end (`--processes 1,2`).

Usage: python benchmarks/pipeline_overhead.py [DOCS] [--small-files 20000,200000|0] [--skip-end-to-end]
       [--processes 1,2]
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


PER_FILE = 10_000  # records per input file, and per partition


def write_corpus(folder: Path, docs: int) -> list[str]:
    """`docs` documents of about 2 KB in files of PER_FILE: 2,000 texts, each 50 times with its own "Reference <n>."
    at the end (every document a near and semantic neighbour of 49 others, which the number guard refuses: the
    dedup's worst case, nothing reused). The 2,000 texts."""
    from pipeline.dev.samples import synthetic_document

    rng = random.Random(5)
    folder.mkdir(parents=True)
    pool_of_texts = [synthetic_document(rng, 22) for _ in range(2000)]  # ~2 KB each
    for f in range(0, docs, PER_FILE):
        with open(folder / f"part-{f // PER_FILE:03d}.jsonl", "w") as out:
            for i in range(f, min(docs, f + PER_FILE)):
                text = pool_of_texts[i % len(pool_of_texts)] + f" Reference {i}."
                out.write(json.dumps({"id": f"d{i}", "text": text, "tenant": f"t{i % 3}"}) + "\n")
    return pool_of_texts


def timed_fake_engine() -> dict[str, float]:
    """Wrap the fake engine's own work (drawing answers: `add`, `step`, `generate`, `prefill`) to add up its
    seconds, so the end-to-end figure can be given without the stand-in's share; returns the running total."""
    import functools
    import threading

    from pipeline.generate.fake_engine import FakeEngine

    spent, calls = {"seconds": 0.0}, threading.local()  # tier workers are threads: nesting is per thread

    def timed(method):
        @functools.wraps(method)
        def wrapper(*args, **kwargs):
            calls.depth = getattr(calls, "depth", 0) + 1  # step -> prefill is counted once, in step
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                calls.depth -= 1
                if not calls.depth:
                    spent["seconds"] += time.perf_counter() - started

        return wrapper

    for name in ("add", "step", "generate", "prefill"):
        setattr(FakeEngine, name, timed(getattr(FakeEngine, name)))
    return spent


def end_to_end(docs: int) -> None:
    from pipeline import run_job
    from pipeline.generate.engine_api import load_tokenizer
    from pipeline.generate.requests import render_prompts, tokenize

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        pool_of_texts = write_corpus(tmp / "in", docs)
        size = sum(p.stat().st_size for p in (tmp / "in").iterdir())
        config = tiny_config(tmp, PER_FILE)
        fake = timed_fake_engine()
        started = time.perf_counter()
        manifest = run_job(config, job_id="bench").manifest.as_json()
        seconds = time.perf_counter() - started
        staging_s = manifest["staging"]["seconds"]
        part_s = sum(p["seconds"] or 0 for p in manifest["partitions"].values())
        # The ceiling set by exact prompt tokenisation: the same prompts rendered and tokenised alone.
        tier = config.largest_tier
        tokenizer = load_tokenizer(config.tiers[tier].model)
        sample = [pool_of_texts[i % len(pool_of_texts)] + f" Reference {i}." for i in range(min(docs, 20_000))]
        started = time.perf_counter()
        tokenize(tokenizer, render_prompts(tokenizer, sample, config.prompt))
        tokenise_rate = len(sample) / (time.perf_counter() - started)
        emit(
            "pipeline_overhead",
            {
                "engine": "fake (no inference)",
                "documents": docs,
                "input_mb": round(size / 1e6, 1),
                "seconds": round(seconds, 2),
                "docs_per_second": round(docs / seconds),
                # the stand-in's own work (drawing answers), summed over its calls; the rest is tokenmill's
                "fake_engine_seconds": round(fake["seconds"], 2),
                "docs_per_second_without_fake_engine": round(docs / max(seconds - fake["seconds"], 1e-9)),
                "target_docs_per_second": 2000,
                "staging_seconds (read, validate, dedup, route, write staged partitions)": staging_s,
                "partition_seconds (lookup, tokenise, store, price, write)": round(part_s, 2),
                "dedup_seconds": manifest["staging"]["dedup"]["seconds"],
                f"tokenisation_alone_docs_per_second (tier {tier}'s tokenizer, chat template included)": round(
                    tokenise_rate
                ),
                "outputs": manifest["counts"]["outputs"],
            },
        )


def _warm(barrier) -> None:
    import pipeline.job.orchestrate  # noqa: F401 (a task process's imports, paid before the clock starts)

    barrier.wait()  # every process of the pool started and warm before the first task


def _step(args):
    """One task: (orchestrate function name, config, job id, argument); its result and its seconds."""
    from pipeline.job import orchestrate

    name, config, job_id, arg = args
    started = time.perf_counter()
    result = getattr(orchestrate, name)(config, job_id, arg)
    return result, time.perf_counter() - started


def mapped(docs: int, processes: int) -> dict:
    """The job as an orchestrator runs it: each step's tasks on a pool of `processes` processes, with as many
    tier workers per tier (as `run.tier_workers` would), as GPU hosts with a CPU each: they share the tier's units."""
    import multiprocessing

    from pipeline.job import orchestrate
    from pipeline.job.context import JobContext
    from pipeline.stores.catalog import migrate

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_corpus(tmp / "in", docs)
        config = tiny_config(tmp, PER_FILE)
        context = multiprocessing.get_context("spawn")
        barrier = context.Barrier(processes + 1)  # handed to each process as it starts
        with context.Pool(processes, initializer=_warm, initargs=(barrier,)) as pool:
            barrier.wait()
            seconds, results = {}, {}
            started = time.perf_counter()
            migrate(config.state.url)  # what the DAG's first task does before planning
            partitions = orchestrate.planned_partitions(config, "bench")
            seconds["plan"] = time.perf_counter() - started
            for step, args in (
                ("prepare", [("prepared_partition", config, "bench", p) for p in partitions]),
                (
                    "drain",
                    [
                        ("drained_tier", config, "bench", t)
                        for t in JobContext.open(config, "bench").drain_order()
                        for _ in range(processes)
                    ],
                ),
                ("commit", [("committed_partition", config, "bench", p) for p in partitions]),
            ):
                at = time.perf_counter()
                results[step] = pool.map(_step, args, chunksize=1)
                seconds[step] = time.perf_counter() - at
            total = time.perf_counter() - started
        manifest = orchestrate.job_manifest(config, "bench")
    return {
        "processes": processes,
        "partitions": len(partitions),
        "seconds": round(total, 2),
        "docs_per_second": round(docs / total),
        "step_seconds": {k: round(v, 2) for k, v in seconds.items()},
        "tier_workers": [
            {**{k: r[k] for k in ("tier", "units", "requests")}, "seconds": round(s, 2)} for r, s in results["drain"]
        ],
        "outputs": manifest.counts.outputs,
    }


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
    import argparse

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.common import emit

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("docs", nargs="?", type=int, default=100_000)
    parser.add_argument("--small-files", default="20000,200000", help="file counts; 0: none")
    parser.add_argument("--skip-end-to-end", action="store_true")
    parser.add_argument("--processes", default="", help="e.g. 1,2: the job's steps as tasks on N processes")
    args = parser.parse_args()
    if not args.skip_end_to_end:
        end_to_end(args.docs)
    processes = [int(n) for n in args.processes.split(",") if n]
    if processes:
        cases = [mapped(args.docs, n) for n in processes]
        emit(
            "pipeline_overhead_mapped",
            {"documents": args.docs, "what": "each step's tasks on N processes", "cases": cases},
        )
    sizes = [int(n) for n in args.small_files.split(",") if int(n)]
    if sizes:
        emit(
            "pipeline_overhead_small_files",
            {
                "what": "planning alone (read, validate, key, dedup, stage) over one-document .txt files, packed",
                "records_per_partition": 10_000,
                "cases": [small_files(n) for n in sizes],
            },
        )
