"""Chaos, as a standing test: a job of a few hundred documents over many partitions, killed with SIGKILL
at the points where a kill hurts most and at random moments, each time followed by `tokenmill rerun`.

Whatever moment a kill lands on, the promises hold at the end: every record exactly once in outputs or
quarantine, no id twice, no item charged twice, the ledger's GPU-seconds equal to what the engines were
held × their GPUs, each Delta table holds every partition once at the claim epoch the catalog committed,
and no temporary file is left. The random moments come from a printed seed, so a failure can be replayed:
TOKENMILL_CHAOS_SEED=<seed> TOKENMILL_CHAOS_KILLS=<n> TOKENMILL_CHAOS_DOCUMENTS=<n> pytest tests/system/test_chaos.py
(the suite: 5 kills over 120 documents; `make chaos`: 20 kills over 240, with a fresh seed). The Batch API
server gets its own drill: the server and its job killed at random moments, the server restarted, a batch
cancelled after a restart (TOKENMILL_CHAOS_SERVE_KILLS, TOKENMILL_CHAOS_SERVE_REQUESTS).
"""

import json
import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import time

import httpx
import openai

from pipeline.dev.samples import write_sample_corpus
from pipeline.job import faults
from pipeline.output.tables import KINDS, open_table
from pipeline.serve.runner import MAX_ATTEMPTS
from pipeline.stores import storage
from tests.conftest import REPO, TINY_CONFIG
from tests.integration.test_batch_files import OTHER, chat
from tests.integration.test_serve_runner import alive
from tests.jobs import assert_exactly_once, cli_env, scalar, start_cli

KILLS = int(os.environ.get("TOKENMILL_CHAOS_KILLS", "5"))
# 120 documents (10 partitions) in the suite; `make chaos` runs 240 (20 partitions).
DOCUMENTS = int(os.environ.get("TOKENMILL_CHAOS_DOCUMENTS", "120"))
SEED = int(os.environ.get("TOKENMILL_CHAOS_SEED", "2026"))

# A run that kills itself at one fault point (pipeline/job/faults.py), the first time it meets it.
KILLED_AT = """
import os, signal, sys
from pipeline import load_config, run_job
from pipeline.job import faults
from pipeline.output.tables import KINDS, open_table

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
        # Every record once, nothing charged twice, ledger = held; each table at the catalog's epochs.
        assert_exactly_once(output, job, counts, tmp_path / "state.db")
        epochs = dict(
            sqlite3.connect(tmp_path / "state.db").execute(
                "select partition, epoch from partitions where job_id = ? and status = 'succeeded'", (job,)
            )
        )
        root = storage.resolve(str(output))
        for kind in KINDS:
            table = open_table(root, kind)
            assert {p: table.transaction_version(f"{job}/{p}") for p in epochs} == epochs, f"{job}: {kind}"
    # No temporary file of a killed write is left.
    assert not [
        p
        for kind in ("outputs", "ledger", "quarantine")
        for p in (output / kind).rglob("*")
        if storage.temporary_target(p.name)
    ]


# The Batch API server under kills: the suite 2 over two batches of 12 requests; `make chaos` 20 over 60 each.
SERVE_KILLS = int(os.environ.get("TOKENMILL_CHAOS_SERVE_KILLS", "2"))
SERVE_REQUESTS = int(os.environ.get("TOKENMILL_CHAOS_SERVE_REQUESTS", "12"))
KEYS = {"acme": "tm-chaos-acme", "globex": "tm-chaos-globex"}


def _serve(env: dict, port: int, log, state_db) -> subprocess.Popen:
    """`tokenmill serve` as a process of its own (its log in a file: a pipe nobody reads would fill), listening
    and running batches: it holds the runner lease, so its catalog's schema is in place (a kill in the middle
    of a first migration is another drill's)."""
    server = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "serve", "--config", str(TINY_CONFIG), "--port", str(port)],
        env=env,
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 120
    while True:
        try:
            httpx.get(f"http://127.0.0.1:{port}/v1/files", timeout=5)
            holder = scalar(state_db, "SELECT holder FROM runner_leases")
            if holder is not None and holder.endswith(f":{server.pid}"):
                return server
        except (httpx.TransportError, sqlite3.OperationalError, TypeError):  # not listening, or no table yet
            pass
        assert server.poll() is None and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.1)


def _running_for(batch_ids: list[str]) -> list[int]:
    """Processes whose command line names one of the batches: a job of them (or its engine) still running."""
    found = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
        except OSError:
            continue
        if any(b in cmdline for b in batch_ids) and alive(int(pid)):
            found.append(int(pid))
    return found


def test_the_batch_server_killed_at_random_answers_every_request_once_and_leaves_no_process(tiny_models, tmp_path):
    """Two tenants' batches; the server or its job SIGKILLed at random moments, the server restarted, one batch
    cancelled after a restart: every request answered or errored exactly once, every paid generation charged
    once with the ledger equal to the engines' held time, and no job process left once the server is gone."""
    from pipeline.serve.access import key_digest

    rng = random.Random(SEED)
    print(f"serve chaos seed {SEED}, {SERVE_KILLS} kills (replay: TOKENMILL_CHAOS_SEED={SEED})")
    env = cli_env(
        tiny_models,
        tmp_path,
        run__progress="off",
        state__lease_seconds=3,
        state__wait_seconds=0.2,
        serve__poll_seconds=0.2,
        dedup__shadow_rate=0,
        tiers__small__fake__step_seconds=0.002,
        tiers__small__served_model_names='["gpt-4o-mini"]',
        **{f"tenants__{t}__api_keys": json.dumps([key_digest(k)]) for t, k in KEYS.items()},
    )
    workdir = tiny_models.parent / "serve"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "serve.log", "ab")  # noqa: SIM115 (the servers write to it)
    server = _serve(env, port, log, tmp_path / "state.db")
    clients = {
        t: openai.OpenAI(api_key=k, base_url=f"http://127.0.0.1:{port}/v1", max_retries=5) for t, k in KEYS.items()
    }
    inputs, batches = {}, {}
    for tenant, client in clients.items():
        lines = [
            chat(f"{tenant}-{i}", f"{OTHER} {tenant} ledger line {i} of the chaos night.")
            for i in range(SERVE_REQUESTS)
        ]
        path = tmp_path / f"{tenant}.jsonl"
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        uploaded = client.files.create(file=path.open("rb"), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        inputs[batch.id], batches[batch.id] = lines, tenant
    moments, cancelled = [], None
    try:
        job_kills = dict.fromkeys(batches, 0)
        for kill in range(SERVE_KILLS):
            time.sleep(rng.uniform(0.2, 3.0))  # a random moment of the batches' run: the point of the drill
            # A job killed MAX_ATTEMPTS times is finalised with what it has: the drill kills each at most once less.
            pidfiles = [workdir / f"{b}.pid" for b in batches if (workdir / f"{b}.pid").exists()]
            pidfiles = [p for p in pidfiles if job_kills[p.stem] < MAX_ATTEMPTS - 1]
            if kill == 0 or rng.random() < 0.5 or not pidfiles:  # the first: the server, then either
                running = pidfiles[0].stem if pidfiles else None
                job = json.loads(pidfiles[0].read_text())["pid"] if pidfiles else None
                server.send_signal(signal.SIGKILL)
                server.wait()
                moments.append("server")
                deadline = time.monotonic() + 30
                while job is not None and alive(job):  # its job dies with it
                    assert time.monotonic() < deadline, "the job outlived its hard-killed server"
                    time.sleep(0.05)
                server = _serve(env, port, log, tmp_path / "state.db")
                if cancelled is None:  # a cancel after a restart stops the work: of the batch that ran, if one did
                    cancelled = running or next(b for b, t in batches.items() if t == "globex")
                    try:
                        clients[batches[cancelled]].batches.cancel(cancelled)
                    except openai.ConflictError:
                        cancelled = ""  # it had ended already
            else:
                try:
                    os.killpg(json.loads(pidfiles[0].read_text())["pid"], signal.SIGKILL)
                    job_kills[pidfiles[0].stem] += 1
                    moments.append("job")
                except (ProcessLookupError, FileNotFoundError):  # it ended meanwhile
                    moments.append("job (ended first)")
        print("killed:", ", ".join(moments))
        ended = {}
        deadline = time.monotonic() + 600
        while len(ended) < len(batches):
            assert time.monotonic() < deadline, f"batches not ended: {set(batches) - set(ended)}"
            for batch_id, tenant in batches.items():
                b = clients[tenant].batches.retrieve(batch_id)
                if b.status in ("completed", "failed", "cancelled", "expired"):
                    ended[batch_id] = b
            time.sleep(0.5)
        print("ended:", {i: (b.status, b.request_counts.completed, b.request_counts.failed) for i, b in ended.items()})
        for batch_id, b in ended.items():
            assert b.status == ("cancelled" if batch_id == cancelled else "completed"), (batch_id, b.status, b.errors)
            client = clients[batches[batch_id]]
            lines = [
                json.loads(line)
                for file_id in (b.output_file_id, b.error_file_id)
                if file_id
                for line in client.files.content(file_id).text.splitlines()
            ]
            ids = [line["custom_id"] for line in inputs[batch_id]]
            if not lines:  # cancelled before its job began: nothing ran, every request counted failed
                counts = (b.request_counts.completed, b.request_counts.failed)
                assert b.status == "cancelled" and counts == (0, len(ids)), (batch_id, b.status, counts, b.errors)
                continue
            assert sorted(line["custom_id"] for line in lines) == sorted(ids)  # each request answered or errored once
            assert_exactly_once(tmp_path / "output", batch_id, {"ids": ids, "bad_records": 0}, tmp_path / "state.db")
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()
    assert _running_for(list(batches)) == []  # no job or engine of a batch outlived the servers
