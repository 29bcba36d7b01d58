"""Faults ops must survive: a worker killed mid-partition, two workers on one job, reruns, the state DB."""

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys

import pyarrow.compute as pc
import pytest

from pipeline import JobError, run_job
from pipeline.dev.samples import write_sample_corpus
from pipeline.stores.catalog import StateStore
from pipeline.stores.units import UnitQueue
from tests.conftest import REPO, TINY_CONFIG, read_kind
from tests.jobs import assert_exactly_once, cli_env, scalar, start_cli, wait_for


def test_tier_worker_killed_mid_drain_rerun_takes_over_without_paying_twice(make_config, tiny_models, tmp_path, caplog):
    """`kill -9` a run while its tier worker drains, then rerun (as ops would): the rerun takes the dead
    worker's work units over at once, saying so, instead of waiting out their lease (300 s by default);
    it pays nothing twice, and the killed worker's engine time is in the ledger, as lost work."""
    (tmp_path / "input").mkdir()
    import random

    from pipeline.dev.samples import synthetic_document

    rng = random.Random(3)
    docs = [{"id": f"d{i:03d}", "text": synthetic_document(rng, 4)} for i in range(48)]
    (tmp_path / "input" / "one.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    db = tmp_path / "state.db"
    # The fake engine finishes 4 requests, then holds every other one in flight (fake.stall_after) while its
    # steps go on: the worker's session beats record busy time that no stored item carries, and stay so.
    # That is the moment to kill it in, made to happen rather than waited for in a window.
    env = cli_env(tiny_models, tmp_path, tiers__small__fake__stall_after=4, tiers__small__fake__step_seconds=0.01)
    proc = start_cli(["run", "--config", str(TINY_CONFIG), "--job-id", "killed"], env)
    in_flight = (
        "select count(*) from engine_sessions where job_id='killed' and busy_seconds - recorded_seconds > 0.01"
        " and (select count(*) from items where job_id='killed') >= 4"
        " and (select count(*) from work_units where job_id='killed' and status='leased') >= 1"
    )
    try:
        reached = wait_for(
            lambda: (
                db.exists()
                and scalar(db, "select count(*) from sqlite_master where name='engine_sessions'")
                and scalar(db, in_flight)
            ),
            proc,
        )
    finally:
        ended = proc.poll() is not None
        if not ended:
            os.killpg(proc.pid, signal.SIGKILL)  # the worker, mid-drain
    assert reached and not ended, f"the worker never stalled with work in flight: {proc.communicate()[1][-2000:]}"
    proc.wait()
    paid_before = scalar(db, "select count(*) from items where job_id='killed'")
    dead_unstored = scalar(
        db, "select sum((busy_seconds - recorded_seconds) * gpus) from engine_sessions where job_id='killed'"
    )
    assert scalar(db, "select status from partitions where job_id='killed'") != "succeeded"  # never committed
    assert scalar(db, "select count(*) from work_units where job_id='killed' and status='leased'") >= 1
    lease_end = scalar(db, "select max(lease_expires_at) from work_units where job_id='killed'")
    assert not (tmp_path / "output" / "outputs" / "job=killed").exists()

    config = make_config()  # the same recipe (the stall is not part of what an output is): nothing paid twice
    with caplog.at_level("WARNING", logger="pipeline.job.drain"):
        m = run_job(config, job_id="killed").manifest.as_json()  # its holder is provably gone: taken over at once
    assert m["status"] == "succeeded"
    assert f"its holder {socket.gethostname()}:{proc.pid} is gone" in caplog.text
    assert (
        scalar(
            db,
            "select count(*) from unit_claims c join work_units u using (job_id, unit_id) "
            "where c.job_id='killed' and c.finished = 0 and c.epoch < u.epoch",
        )
        >= 1
    )  # taken over
    # Finished long before the dead worker's leases would have ended (both on the database's clock).
    assert scalar(db, "select max(finished_at) from work_units where job_id='killed'") < lease_end
    outputs = assert_exactly_once(tmp_path / "output", "killed", {"ids": [d["id"] for d in docs], "bad_records": 0}, db)
    assert outputs.num_rows == len(docs) and paid_before < len(docs)
    ledger = read_kind(tmp_path / "output", "ledger", "killed")
    lost = [r for r in ledger.to_pylist() if r["kind"] == "lost"]
    assert lost and all(r["gpu_seconds"] > 0 and r["tier"] == "small" for r in lost), "the dead worker's time is billed"
    # Exactly what it measured and never stored; the rest of what it held is on the items it did store.
    assert sum(r["gpu_seconds"] for r in lost) == pytest.approx(dead_unstored, rel=1e-9)
    assert m["engines"]["small"]["workers"] == 2  # the killed one's session counts as held


def test_two_workers_on_one_job_process_each_partition_once(tiny_models, tmp_path):
    counts = write_sample_corpus(tmp_path / "input", documents=40)
    # Small partitions (about 15), both workers on them at once: each partition is committed once, by one of
    # them, every record is accounted once and nothing is paid twice, whoever did what.
    env = cli_env(tiny_models, tmp_path, run__progress="off", input__records_per_partition=4)
    procs = [start_cli(["run", "--config", str(TINY_CONFIG), "--job-id", "twice"], env) for _ in range(2)]
    results = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [r[1][-1500:] for r in results]
    db = tmp_path / "state.db"
    assert scalar(db, "select max(attempts) from partitions where job_id='twice'") == 1
    with sqlite3.connect(db) as c:
        committed_by = dict(c.execute("select worker, count(*) from partitions where job_id='twice' group by worker"))
        drained_by = dict(c.execute("select worker, count(*) from work_units where job_id='twice' group by worker"))
    # Whichever worker's engine is up first takes the units it can keep in flight (2 x max_num_seqs, here
    # every one) and may commit them all before the other looks: who did what is not asserted, only that
    # each partition was committed once, every unit done once, and every record and GPU-second accounted once.
    print("committed by", committed_by, "drained by", drained_by)
    assert scalar(db, "select count(*) from work_units where job_id='twice' and status != 'done'") == 0
    assert_exactly_once(tmp_path / "output", "twice", counts, db)  # and the ledger charges what the catalog paid


def rows_without_created_at(table) -> list[dict]:
    rows = table.drop_columns([c for c in ("created_at",) if c in table.column_names]).to_pylist()
    return sorted(rows, key=repr)


def test_rerun_of_succeeded_partitions_changes_nothing_and_costs_nothing(
    make_config, sample_corpus, tiny_models, tmp_path
):
    config = make_config()
    first = run_job(config, job_id="again").manifest.as_json()
    before = {k: read_kind(tmp_path / "output", k, "again") for k in ("outputs", "ledger", "quarantine")}
    env = cli_env(tiny_models, tmp_path, run__progress="off")
    parts = [f"--partition={p}" for p in first["partitions"]]
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.cli",
            "rerun",
            "--config",
            str(TINY_CONFIG),
            "--job-id",
            "again",
            "--json",
            *parts,
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    second = json.loads(r.stdout)
    # No engine started, no engine time added, same money.
    assert {t: e["held_seconds"] for t, e in second["engines"].items()} == {
        t: e["held_seconds"] for t, e in first["engines"].items()
    }
    assert second["cost"] == first["cost"]
    for kind, table in before.items():
        after = read_kind(tmp_path / "output", kind, "again")
        assert after.schema.equals(table.schema)
        # The same rows, in whatever order the table's files are listed (a Delta snapshot does not order them).
        assert rows_without_created_at(after) == rows_without_created_at(table)
    status = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.cli",
            "status",
            "--config",
            str(TINY_CONFIG),
            "--job-id",
            "again",
            "--format",
            "json",
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    parts = json.loads(status.stdout)["partitions"]
    assert {p["status"] for p in parts} == {"succeeded"} and {p["attempts"] for p in parts} == {2}
    listing = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "jobs", "list", "--config", str(TINY_CONFIG), "--format", "json"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    assert [(j["job_id"], j["status"]) for j in json.loads(listing.stdout)] == [("again", "succeeded")]


def test_failed_partition_reruns_alone(make_config, sample_corpus, tmp_path, monkeypatch):
    from pipeline.job import faults

    config = make_config()
    victim = {}

    def flaky(point, job, partition):
        if point == "before_commit" and not victim:  # assembled, nothing written yet
            victim["p"] = partition
            raise OSError("disk went away")

    with faults.inject(flaky), pytest.raises(JobError, match="1 of .* partitions not committed.*disk went away"):
        run_job(config, job_id="flaky")
    assert not (tmp_path / "output" / "outputs" / "job=flaky" / f"partition={victim['p']}").exists()  # nothing written
    state = StateStore(config.state.url)
    attempts_before = {p.partition: p.attempts for p in state.partitions("flaky")}
    run_job(config, job_id="flaky")
    after = {p.partition: (p.status, p.attempts) for p in state.partitions("flaky")}
    assert after[victim["p"]] == ("succeeded", 2)
    assert all(a == ("succeeded", attempts_before[p]) for p, a in after.items() if p != victim["p"])
    assert_exactly_once(tmp_path / "output", "flaky", sample_corpus[1], tmp_path / "state.db")


def test_unreachable_state_database_is_one_clear_line(tiny_models, tmp_path, sample_corpus):
    env = cli_env(tiny_models, tmp_path, state__url="postgresql+psycopg://tm:hunter2@127.0.0.1:1/db")
    r = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "run", "--config", str(TINY_CONFIG)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0 and "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: job failed: state database") and "unreachable" in last and "hunter2" not in r.stderr


def test_job_on_postgresql(make_config, sample_corpus, fresh_postgres_url, tmp_path):
    # A database of its own: the session's is shared by every catalog test, and a repeated run of this one
    # (make test-repeat) would find its job id there already, bound to another output.
    postgres_url = fresh_postgres_url
    config = make_config(state__url=postgres_url)
    m = run_job(config, job_id="pg").manifest.as_json()
    assert m["status"] == "succeeded"
    assert m["counts"]["records"] == sample_corpus[1]["documents"] + sample_corpus[1]["bad_records"]
    # The session's PostgreSQL database is shared with the other catalog tests: look at this job only.
    assert [(j.job_id, j.status) for j in StateStore(postgres_url).jobs() if j.job_id == "pg"] == [("pg", "succeeded")]


def test_state_database_outage_mid_job_leaves_no_partition_running_forever(
    make_config, tmp_path, fresh_postgres_url, monkeypatch
):
    """A real outage: the catalog's PostgreSQL connection is cut after the first paid engine call."""
    from sqlalchemy import text
    from sqlalchemy.engine import make_url

    from tests.tcpproxy import CuttableTcpProxy

    postgres_url = fresh_postgres_url  # its own database, as test_job_on_postgresql's
    url = make_url(postgres_url)
    proxy = CuttableTcpProxy(url.host, url.port or 5432)
    proxied = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    write_sample_corpus(tmp_path / "input", documents=30)
    config = make_config(state__url=proxied, state__lease_seconds=2)
    real_store = StateStore.store_items

    def store_then_cut(self, job_id, items):
        real_store(self, job_id, items)
        proxy.cut()

    monkeypatch.setattr(StateStore, "store_items", store_then_cut)
    with pytest.raises(JobError) as e:
        run_job(config, job_id="dbdown")
    message = str(e.value)
    assert "state database" in message and "unreachable" in message and "\n" not in message
    monkeypatch.setattr(StateStore, "store_items", real_store)
    proxy.restore()

    state = StateStore(postgres_url)
    held = [u for u in UnitQueue(state).units("dbdown") if u.status == "leased"]
    assert held and all(u.lease_expires_at is not None for u in held)  # held only until the lease ends
    m = run_job(config, job_id="dbdown").manifest.as_json()  # takes the abandoned units over once their lease is out
    assert m["status"] == "succeeded"
    assert {p.status for p in state.partitions("dbdown")} == {"succeeded"}
    with state.db_session() as s:
        paid = s.execute(text("select count(*), coalesce(sum(gpu_seconds), 0) from items where job_id='dbdown'")).one()
    ledger = read_kind(tmp_path / "output", "ledger", "dbdown")
    outputs = read_kind(tmp_path / "output", "outputs", "dbdown")
    served = ledger.filter(pc.equal(ledger["kind"], "output"))
    assert len(set(outputs["id"].to_pylist())) == outputs.num_rows == served.num_rows
    generated = [r for r in served.to_pylist() if r["source"] == "generated"]
    assert len(generated) == paid[0] and sum(r["busy_gpu_seconds"] for r in generated) == pytest.approx(paid[1])
    # The worker cut off mid-drain never closed its engine session: what it measured but never stored is
    # billed as lost, and the ledger still adds up to every engine-second held.
    assert set(ledger["kind"].to_pylist()) <= {"output", "lost"}
    with state.db_session() as s:
        held = s.execute(
            text(
                "select sum((startup_seconds + busy_seconds + idle_seconds) * gpus) "
                "from engine_sessions where job_id='dbdown'"
            )
        ).scalar()
    assert sum(ledger["gpu_seconds"].to_pylist()) == pytest.approx(held, rel=1e-6)
    proxy.close()


def test_a_killed_planner_is_taken_over_at_once_and_named(make_config, sample_corpus, tiny_models, tmp_path, caplog):
    """Reproducer (red team): after a SIGKILL during planning, `tokenmill rerun` waited the whole staging
    lease (300 s) and printed nothing; a dead partition holder, by contrast, was taken over at once."""
    import threading

    from tests.system.test_chaos import KILLED_AT

    # A lease of 15 s: the gone planner is replaced after a third of it (5 s of silence), by the path that
    # says so, not when the lease ends (the default lease, 300 s, was waited out in silence).
    env = cli_env(tiny_models, tmp_path, input__uri=str(sample_corpus[0]), state__lease_seconds=15)
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_AT, "before_register", str(TINY_CONFIG), "planner"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    db = tmp_path / "state.db"
    assert scalar(db, "select status from jobs where job_id='planner'") == "planning"
    done = []
    with caplog.at_level("INFO", logger="pipeline.job.plan"):
        rerun = threading.Thread(
            target=lambda: done.append(run_job(make_config(state__lease_seconds=15), job_id="planner")), daemon=True
        )
        rerun.start()
        rerun.join(timeout=120)  # a guard against the 300 s wait the bug was; nothing here is timed
    assert done and done[0].manifest.as_json()["status"] == "succeeded", "the rerun waited out the dead planner's lease"
    planner = scalar(db, "select planning_worker from jobs where job_id='planner'")  # the rerun's process, now
    assert planner == f"{socket.gethostname()}:{os.getpid()}" and "its planning worker" in caplog.text
    assert "is gone (no such process on this host); planning it again now" in caplog.text
    assert scalar(db, "select planning_epoch from jobs where job_id='planner'") == 2
