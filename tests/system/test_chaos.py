"""Chaos, as a standing test: a job of a few hundred documents over many partitions, killed with SIGKILL
at the points where a kill hurts most and at random moments, each time followed by `tokenmill rerun`.

Whatever moment a kill lands on, the promises hold at the end: every record exactly once in outputs or
quarantine, no id twice, no item charged twice, the ledger's GPU-seconds equal to what the engines were
held × their GPUs, readers that honour commits and a plain glob of the folders see the same rows, and no
temporary file is left. The random moments come from a printed seed, so a failure can be replayed:
TOKENMILL_CHAOS_SEED=<seed> TOKENMILL_CHAOS_KILLS=<n> TOKENMILL_CHAOS_DOCUMENTS=<n> pytest tests/system/test_chaos.py
(the suite: 5 kills over 120 documents; `make chaos`: 20 kills over 240, with a fresh seed).
"""

import os
import random
import signal
import subprocess
import sys

import duckdb

from pipeline.dev.samples import write_sample_corpus
from pipeline.job import faults
from pipeline.stores import storage
from tests.conftest import REPO, TINY_CONFIG, read_kind
from tests.jobs import assert_exactly_once, cli_env, start_cli

KILLS = int(os.environ.get("TOKENMILL_CHAOS_KILLS", "5"))
# 120 documents (10 partitions) in the suite; `make chaos` runs 240 (20 partitions).
DOCUMENTS = int(os.environ.get("TOKENMILL_CHAOS_DOCUMENTS", "120"))
SEED = int(os.environ.get("TOKENMILL_CHAOS_SEED", "2026"))

# A run that kills itself at one fault point (pipeline/job/faults.py), the first time it meets it.
KILLED_AT = """
import os, signal, sys
from pipeline import load_config, run_job
from pipeline.job import faults

def die(point, job_id, partition):
    if point == sys.argv[1]:
        os.kill(os.getpid(), signal.SIGKILL)

with faults.inject(die):
    run_job(load_config(sys.argv[2]), job_id=sys.argv[3])
"""


def test_random_kills_and_reruns_keep_every_promise(tiny_models, tmp_path):
    print(
        f"chaos seed {SEED}, {KILLS} random kills over {DOCUMENTS} documents (replay: TOKENMILL_CHAOS_SEED={SEED} "
        f"TOKENMILL_CHAOS_KILLS={KILLS} TOKENMILL_CHAOS_DOCUMENTS={DOCUMENTS})"
    )
    rng = random.Random(SEED)
    counts = write_sample_corpus(tmp_path / "input", documents=DOCUMENTS)
    # A dead planner, partition holder or tier worker on this host is taken over at once; short leases bound
    # the rest. The fake engine's step time keeps the drain long enough for random kills to land in it too.
    env = cli_env(
        tiny_models,
        tmp_path,
        run__progress="off",
        input__records_per_partition=12,
        state__lease_seconds=3,
        state__wait_seconds=0.2,
        tiers__small__fake__step_seconds=0.002,
    )
    for point in faults.POINTS:
        killed = subprocess.run(
            [sys.executable, "-c", KILLED_AT, point, str(TINY_CONFIG), "chaos"],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert killed.returncode == -signal.SIGKILL, f"{point}: {killed.stderr[-2000:]}"
    # Random moments: a job that finishes before its kill is done with; the next kills go to a new job
    # over the same input (its planning, the cache's exact hits and its commits are then what they hit).
    moments, jobs = [], ["chaos"]
    for _ in range(KILLS):
        proc = start_cli(["run", "--config", str(TINY_CONFIG), "--job-id", jobs[-1]], env)
        moment = rng.uniform(0.3, 5.0)
        try:
            proc.wait(timeout=moment)
            moments.append(f"{jobs[-1]} {moment:.2f}s (finished first, rc {proc.returncode})")
            jobs.append(f"chaos-{len(jobs)}")
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            moments.append(f"{jobs[-1]} {moment:.2f}s")
    print("killed at", ", ".join(moments))
    output = tmp_path / "output"
    for job in jobs:
        last = start_cli(["run", "--config", str(TINY_CONFIG), "--job-id", job], env)
        _, err = last.communicate(timeout=600)
        assert last.returncode == 0, err[-3000:]
        # Every record once, nothing charged twice, ledger = held; a glob reads what the commits name.
        assert_exactly_once(output, job, counts, tmp_path / "state.db")
        committed = read_kind(output, "ledger", job).num_rows
        globbed = duckdb.sql(f"SELECT count(*) FROM read_parquet('{output}/ledger/job={job}/**/*.parquet')").fetchall()
        assert globbed[0][0] == committed, f"{job}: a plain glob sees files no commit names"
    # What killed writes left of the data is swept (a temporary commit record is swept once it is 10 minutes
    # old, and never read: readers skip dot-files).
    assert not [
        p
        for kind in ("outputs", "ledger", "quarantine")
        for p in (output / kind).rglob("*")
        if storage.temporary_target(p.name)
    ]
