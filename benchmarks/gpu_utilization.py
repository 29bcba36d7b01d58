"""GPU utilisation: engine-seconds held for one job's GPU work, in two shapes.

One job (the sample corpus, --documents records in at least --partitions partitions) on the tiny CPU
tiers of configs/tiny.yaml, routing and escalation as configured there (both tiers get work), run
twice in one benchmark run, each shape with its own output folder, state catalog and cache (both
start cold), every step in a fresh OS process the way an orchestrator's tasks are:

  (a) per partition  one process per partition, one after another: prepare the partition, drain every
                     tier for it alone, commit it. Its engines start and stop once per partition.
                     Partition p is prepared just before its own drain, so a drain (which takes every
                     pending unit of the job) only sees that partition's units.
  (b) tier workers   prepare every partition; then one process per tier drains the tier's units of
                     all partitions (its engine started once), the escalation tier last, since the
                     others feed it; then commit every partition.

The tier workers run one after another, not side by side: on a CPU host two engines would share the
same cores, and the escalation tier's worker would wait on the small tier's output (idle time it
would not have with each tier on its own GPU and its work already queued).

Printed per tier and shape (from the manifest's `engines`): engine starts, held / start-up / busy / idle
engine-seconds, utilisation = busy / held, and the ratio of held engine-seconds (a)/(b). Targets, for
(b): each engine starts once per worker; idle after start-up <= 5% of held; the ledger's gpu_seconds
add up to sum(held x GPUs) within 1e-6 relative; and (a) holds the engines >= 3x as long as (b).
Idle includes the engine's teardown: a worker holds its engine until its memory is free again (vLLM
on the CPU takes about 5 s to stop), so it weighs more on a short run. A table, then one JSON line.
Engine: the tiny random-weight models on the CPU; a real model on a GPU starts in minutes, not tens
of seconds, so there start-up weighs more in (a) and the ratio grows.
Usage: python benchmarks/gpu_utilization.py [--documents 3000] [--partitions 30] [--lock PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "tiny.yaml"
RESULT = "gpu-utilization-step-result "  # the line a step process ends its stdout with
TIMES = ("startup_seconds", "busy_seconds", "idle_seconds", "held_seconds")


# -- one step, in its own process ----------------------------------------------------------------------
def run_step(step: dict) -> dict:
    """What one orchestrator task does, on the job the environment's TOKENMILL_* settings name."""
    from pipeline.config import load_config
    from pipeline.job.commit import commit_partition
    from pipeline.job.context import JobContext
    from pipeline.job.drain import drain_tier
    from pipeline.job.manifest import refresh_manifest
    from pipeline.job.plan import plan
    from pipeline.job.prepare import prepare
    from pipeline.stores.catalog import migrate

    config = load_config(CONFIG)
    kind = step["kind"]
    if kind == "plan":  # the first step of a run: the one that brings the catalog to the latest schema
        migrate(config.state.url)
    job = JobContext.open(config, step["job_id"])
    if kind == "plan":
        plan(job)
        return {"partitions": [p.partition for p in job.state.partitions(job.job_id)], "tiers": job.drain_order()}
    if kind == "partition":  # shape (a): one partition on its own, every tier
        prepared = prepare(job.preparing(), step["partition"])
        drains = [drain_tier(job.draining(), tier) for tier in job.drain_order()]
        return {"prepared": prepared, "drains": drains, "commit": commit_partition(job.committing(), step["partition"])}
    if kind == "prepare":  # shape (b), CPU: every partition's wave 0
        return {"prepared": [prepare(job.preparing(), p) for p in step["partitions"]]}
    if kind == "drain":  # shape (b), one tier worker
        return {"drains": [drain_tier(job.draining(), step["tier"])]}
    if kind == "commit":
        return {"commits": [commit_partition(job.committing(), p) for p in step["partitions"]]}
    if kind == "finish":
        manifest = refresh_manifest(job.manifests()).as_json()
        return {
            "manifest": {k: manifest[k] for k in ("status", "counts", "cost", "engines", "routing")},
            "ledger": ledger_sums(job.config.output.uri, job.job_id),
        }
    raise ValueError(f"unknown step {kind!r}")


def ledger_sums(output_uri: str, job_id: str) -> dict:
    """The job's committed ledger rows (the ledger table's latest snapshot): GPU-seconds in all and per tier."""
    import pyarrow.compute as pc
    import pyarrow.dataset as ds

    from pipeline.output.tables import open_table, read
    from pipeline.stores import storage

    root = storage.resolve(output_uri)
    ledger = read(root, "ledger", filter=ds.field("job_id") == job_id)
    files = [u for u in open_table(root, "ledger").file_uris() if f"/job_id={job_id}/" in u]
    cols = ("gpu_seconds", "busy_gpu_seconds", "overhead_gpu_seconds")

    def sums(t):
        return {c: float(pc.sum(t[c]).as_py() or 0.0) for c in cols}

    tiers = sorted(t for t in set(ledger["tier"].to_pylist()) if t is not None)
    return {
        "rows": ledger.num_rows,
        "files": len(files),
        **sums(ledger),
        "by_tier": {t: sums(ledger.filter(pc.equal(ledger["tier"], t))) for t in tiers},
    }


# -- the benchmark ---------------------------------------------------------------------------------------
class Steps:
    """Runs steps of one shape's job in fresh processes, with that shape's environment; keeps their wall time."""

    def __init__(self, shape: str, env: dict, logs: Path, job_id: str, lock: str | None = None):
        self.shape, self.env, self.logs, self.job_id, self.lock = shape, env, logs, job_id, lock
        self.n, self.seconds = 0, 0.0

    def __call__(self, kind: str, **fields) -> dict:
        self.n += 1
        log = self.logs / f"{self.shape}-{self.n:03d}-{kind}.log"
        started = time.perf_counter()
        with open(log, "w") as out:
            done = subprocess.run(
                [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "--step",
                    json.dumps({"kind": kind, "job_id": self.job_id, "lock": self.lock, **fields}),
                ],
                env=self.env,
                stdout=subprocess.PIPE,
                stderr=out,
                text=True,
                cwd=REPO,
            )
        lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
        if done.returncode != 0 or not lines:
            tail = "".join(log.read_text().splitlines(keepends=True)[-40:])
            raise SystemExit(
                f"shape {self.shape}: step {kind} {fields or ''} failed (exit {done.returncode}); "
                f"last lines of its log {log}:\n{tail}{done.stdout[-2000:]}"
            )
        result = json.loads(lines[-1][len(RESULT) :])
        seconds = time.perf_counter() - started - result.pop("lock_wait_seconds", 0.0)
        self.seconds += seconds
        print(
            f"  [{self.shape}] {kind} {fields.get('partition') or fields.get('tier') or ''} {seconds:.1f} s",
            file=sys.stderr,
            flush=True,
        )
        return result


def shape_env(tmp: Path, shape: str, records_per_partition: int) -> dict:
    # Only TOKENMILL_HOME of the caller's TOKENMILL_* settings: the benchmark's job is the same everywhere.
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_") or k == "TOKENMILL_HOME"}
    env.setdefault("TOKENMILL_HOME", str(REPO / ".tokenmill"))
    work = tmp / shape
    work.mkdir()
    return {
        **env,
        "TOKENMILL_INPUT__URI": str(tmp / "in"),
        "TOKENMILL_OUTPUT__URI": str(work / "out"),
        "TOKENMILL_STATE__URL": f"sqlite:///{work}/state.db",
        "TOKENMILL_CACHE__PATH": str(work / "cache"),
        "TOKENMILL_RUN__PROGRESS": "off",
        "TOKENMILL_INPUT__RECORDS_PER_PARTITION": str(records_per_partition),
        "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "WARNING"),
    }


def per_partition(steps: Steps) -> dict:
    planned = steps("plan")
    for p in planned["partitions"]:
        steps("partition", partition=p)
    return {**planned, **steps("finish")}


def tier_workers(steps: Steps) -> dict:
    planned = steps("plan")
    steps("prepare", partitions=planned["partitions"])
    for tier in planned["tiers"]:
        steps("drain", tier=tier)
    steps("commit", partitions=planned["partitions"])
    return {**planned, **steps("finish")}


def figures(result: dict, steps: Steps) -> dict:
    engines = result["manifest"]["engines"]
    tiers = {}
    for tier in sorted(engines):
        e = engines[tier]
        tiers[tier] = {
            "workers": e.get("workers", 0),
            "starts": e.get("starts", 0),
            **{k: round(e.get(k, 0.0), 3) for k in TIMES},
            "held_gpu_seconds": round(e.get("held_gpu_seconds", 0.0), 3),
            "utilisation": e.get("utilisation"),
            "idle_share_of_held": round(e["idle_seconds"] / e["held_seconds"], 4) if e.get("held_seconds") else None,
            "items": e.get("items", 0),
            "output_tokens": e.get("output_tokens", 0),
        }
    held_gpu = sum(e.get("held_gpu_seconds", 0.0) for e in engines.values())
    ledger = result["ledger"]
    return {
        "partitions": len(result["partitions"]),
        "processes": steps.n,
        "wall_seconds": round(steps.seconds, 1),
        "tiers": tiers,
        "held_seconds": round(sum(e.get("held_seconds", 0.0) for e in engines.values()), 3),
        "held_gpu_seconds": round(held_gpu, 6),
        "ledger_gpu_seconds": round(ledger["gpu_seconds"], 6),
        "ledger_busy_gpu_seconds": round(ledger["busy_gpu_seconds"], 6),
        "ledger_overhead_gpu_seconds": round(ledger["overhead_gpu_seconds"], 6),
        "ledger_vs_held_relative_error": abs(ledger["gpu_seconds"] - held_gpu) / held_gpu if held_gpu else None,
        "ledger_by_tier_gpu_seconds": {t: round(v["gpu_seconds"], 6) for t, v in ledger["by_tier"].items()},
        "outputs": result["manifest"]["counts"]["outputs"],
        "by_tier": result["manifest"]["counts"]["by_tier"],
        "escalated": result["manifest"]["routing"].get("escalated", 0),
        "status": result["manifest"]["status"],
    }


def table(a: dict, b: dict) -> str:
    rows = [
        f"{'tier':<7}{'shape':<17}{'workers':>8}{'starts':>7}{'held s':>10}{'start-up s':>11}{'busy s':>9}"
        f"{'idle s':>9}{'util':>7}{'idle/held':>10}"
    ]
    for tier in sorted(set(a["tiers"]) | set(b["tiers"])):
        for name, f in (("(a) per partition", a), ("(b) tier workers", b)):
            e = f["tiers"].get(tier)
            if e is None:
                rows.append(f"{tier:<7}{name:<17}  (no engine)")
                continue
            util = f"{e['utilisation']:.1%}" if e["utilisation"] is not None else "-"
            idle = f"{e['idle_share_of_held']:.1%}" if e["idle_share_of_held"] is not None else "-"
            rows.append(
                f"{tier:<7}{name:<17}{e['workers']:>8}{e['starts']:>7}{e['held_seconds']:>10.1f}"
                f"{e['startup_seconds']:>11.1f}{e['busy_seconds']:>9.1f}{e['idle_seconds']:>9.1f}{util:>7}{idle:>10}"
            )
    return "\n".join(rows)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=3000, help="records in the job (default 3000)")
    parser.add_argument("--partitions", type=int, default=30, help="at least this many partitions (default 30)")
    parser.add_argument(
        "--lock",
        metavar="PATH",
        help="hold flock(PATH) through each step's process, for a host "
        "that other engine work shares (time waiting for it is left out of the wall times)",
    )
    parser.add_argument("--step", help=argparse.SUPPRESS)  # internal: run one step (a task) in this process
    args = parser.parse_args(argv)
    if args.step:
        step, waited = json.loads(args.step), 0.0
        if step.get("lock"):
            import fcntl

            started = time.perf_counter()
            held = open(step["lock"], "a")  # held (locked) until this process exits
            fcntl.flock(held, fcntl.LOCK_EX)
            waited = time.perf_counter() - started
        print(RESULT + json.dumps({**run_step(step), "lock_wait_seconds": waited}, default=str), flush=True)
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed run still removes its temporary folder

    sys.path.insert(0, str(REPO))
    from benchmarks.common import emit
    from pipeline.config import load_config
    from pipeline.dev.samples import write_sample_corpus

    # The sample corpus spreads its records over three files (and two one-record notes): partitions of
    # ceil(documents / partitions) records give every file its share, so at least --partitions in all.
    records_per_partition = max(1, math.ceil(args.documents / args.partitions))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tokenmill-gpu-utilization-") as tmp:
        tmp = Path(tmp)
        corpus = write_sample_corpus(tmp / "in", documents=args.documents, with_bad_input=False)
        (tmp / "logs").mkdir()
        results, steps = {}, {}
        for shape, run in (("a", per_partition), ("b", tier_workers)):
            env = shape_env(tmp, shape, records_per_partition)
            steps[shape] = Steps(shape, env, tmp / "logs", f"gpu-utilization-{shape}", args.lock)
            print(
                f"shape ({shape}): {'one process per partition' if shape == 'a' else 'one process per tier'}",
                file=sys.stderr,
                flush=True,
            )
            results[shape] = run(steps[shape])
        config = load_config(CONFIG, environ=env)
    seconds = time.perf_counter() - started
    gpus = {t: c.gpus for t, c in config.tiers.items()}
    a, b = figures(results["a"], steps["a"]), figures(results["b"], steps["b"])

    ratio = {
        t: round(a["tiers"][t]["held_seconds"] / b["tiers"][t]["held_seconds"], 2)
        for t in a["tiers"]
        if t in b["tiers"] and b["tiers"][t]["held_seconds"]
    }
    ratio_all = round(a["held_seconds"] / b["held_seconds"], 2) if b["held_seconds"] else None
    both_tiers = all(b["tiers"].get(t, {}).get("items") for t in config.tiers)
    targets = {
        "both tiers got work": both_tiers,
        "(b) starts each engine once per worker": all(e["starts"] == e["workers"] == 1 for e in b["tiers"].values()),
        "(b) idle after start-up <= 5% of held": all(
            e["idle_share_of_held"] is not None and e["idle_share_of_held"] <= 0.05 for e in b["tiers"].values()
        ),
        "(b) ledger gpu_seconds = sum(held x GPUs) within 1e-6 relative": b["ledger_vs_held_relative_error"] is not None
        and b["ledger_vs_held_relative_error"] <= 1e-6,
        "(a)/(b) held engine-seconds >= 3x (all tiers together)": ratio_all is not None and ratio_all >= 3,
        "(a)/(b) held engine-seconds >= 3x (every tier)": bool(ratio) and all(r >= 3 for r in ratio.values()),
    }

    print(
        f"\nGPU utilisation: {args.documents} documents, {a['partitions']} partitions, tiny CPU tiers "
        f"(configs/tiny.yaml, GPUs per tier {gpus}); {seconds:.0f} s in all"
    )
    print(table(a, b))
    print(f"held engine-seconds (a)/(b): {', '.join(f'{t} {r}x' for t, r in ratio.items())}; all tiers {ratio_all}x")
    for name, f in (("(a)", a), ("(b)", b)):
        print(
            f"{name} ledger gpu_seconds {f['ledger_gpu_seconds']:.6f} (busy {f['ledger_busy_gpu_seconds']:.6f} + "
            f"overhead {f['ledger_overhead_gpu_seconds']:.6f}) vs sum(held x GPUs) {f['held_gpu_seconds']:.6f}: "
            f"relative error {f['ledger_vs_held_relative_error']:.2e}; {f['processes']} processes, "
            f"{f['wall_seconds']:.0f} s"
        )
    for name, ok in targets.items():
        print(f"  [{'met' if ok else 'MISSED'}] {name}")
    print(flush=True)
    emit(
        "gpu_utilization",
        {
            "engine": (
                "tiny random-weight models on the CPU (small: 1.1 M params, large: 5.5 M); vLLM's own engine loop"
            ),
            "documents": args.documents,
            "corpus": {k: v for k, v in corpus.items() if k != "ids"},
            "records_per_partition": records_per_partition,
            "shapes": {"(a) one process per partition": a, "(b) one tier worker per tier": b},
            "held_ratio_a_over_b": {**ratio, "all": ratio_all},
            "targets": targets,
            "targets_met": all(targets.values()),
            "seconds": round(seconds, 1),
        },
    )


if __name__ == "__main__":
    main(sys.argv[1:])
