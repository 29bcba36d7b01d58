"""The catalog under racing workers, skewed clocks, dead holders and values the database refuses.

Each on SQLite and on a real PostgreSQL server (state_url).
"""

import logging
import multiprocessing
import socket
import subprocess
import sys
import threading
import uuid
from datetime import timedelta

import pytest

from pipeline.stores import catalog
from pipeline.stores.catalog import ItemsRefused, StateStore, aware, migrate
from pipeline.stores.lease import worker_is_gone


@pytest.fixture
def job(store):
    job_id = f"j-{uuid.uuid4().hex[:6]}"
    assert store.claim_planning(job_id, "fp", "in", "out")
    store.add_partitions(job_id, {p: {"file": p, "records": 1} for p in ("p1", "p2", "p3")})
    return job_id


def make_item(summary: str = "s", **fields) -> dict:
    return {
        "id": "a",
        "tenant": "t",
        "partition": "p1",
        "tier": "small",
        "model": "m",
        "summary": summary,
        "prompt_tokens": 3,
        "cached_prompt_tokens": 0,
        "output_tokens": 2,
        "finish_reason": "length",
        "gpu_seconds": 0.5,
        "baseline_gpu_seconds": 0.5,
        "created_at": catalog.now(),
        **fields,
    }


def partition(store, job_id, name):
    return next(p for p in store.partitions(job_id) if p.partition == name)


# -- item 5: overlapping stores from racing workers ------------------------------------------------------

ROUNDS = 25


def store_overlapping(target, job_id, name, barrier, results) -> None:
    """One worker: each round, 8 keys the other worker stores too and 4 of its own, both starting at once.
    Puts (name, {key: summary read back right after storing}) or (name, error) on `results`."""
    try:
        store, seen = StateStore(target) if isinstance(target, str) else target, {}
        for r in range(ROUNDS):
            keys = [f"r{r}-shared-{i}" for i in range(8)] + [f"r{r}-{name}-{i}" for i in range(4)]
            barrier.wait(timeout=30)
            store.store_items(job_id, {k: make_item(name) for k in keys})
            seen |= {k: v["summary"] for k, v in store.stored_items(job_id, keys).items()}
        results.put((name, seen))
    except Exception as e:  # reported to the test, which names it
        results.put((name, f"{type(e).__name__}: {str(e)[:300]}"))


@pytest.mark.parametrize("workers", ["threads", "processes"])
def test_workers_storing_overlapping_keys_at_once_all_land_first_value_kept(store, job, state_url, workers):
    """A read-then-insert lost the later batch, its own keys too, to an IntegrityError (20 of 20 trials)."""
    if workers == "threads":
        import queue

        barrier, results = threading.Barrier(2), queue.Queue()
        # A store each, made here, as each worker has its own.
        runners = [
            threading.Thread(target=store_overlapping, args=(StateStore(state_url), job, n, barrier, results))
            for n in ("a", "b")
        ]
    else:
        ctx = multiprocessing.get_context("spawn")  # fresh interpreters, like two worker processes
        barrier, results = ctx.Barrier(2), ctx.Queue()
        runners = [
            ctx.Process(target=store_overlapping, args=(state_url, job, n, barrier, results)) for n in ("a", "b")
        ]
    for r in runners:
        r.start()
    got = dict(results.get(timeout=120) for _ in runners)
    for r in runners:
        r.join(timeout=60)
    assert all(isinstance(v, dict) for v in got.values()), got  # no worker raised
    expected = {
        f"r{r}-{x}-{i}" for r in range(ROUNDS) for x, n in (("shared", 8), ("a", 4), ("b", 4)) for i in range(n)
    }
    final = {k: v["summary"] for k, v in store.stored_items(job, sorted(expected)).items()}
    assert set(final) == expected  # every key of both workers stored
    for name in ("a", "b"):  # what each worker read back right after its store is still there: never overwritten
        assert {k: final[k] for k in got[name]} == got[name]
    assert {final[f"r{r}-a-0"] for r in range(ROUNDS)} == {"a"} and {final[f"r{r}-b-0"] for r in range(ROUNDS)} == {"b"}
    store.store_items(job, {k: make_item("late") for k in expected})  # storing again: first value wins
    assert {k: v["summary"] for k, v in store.stored_items(job, sorted(expected)).items()} == final


# -- item 2 (store part): one refused value never discards the other paid items ---------------------------


def test_an_item_the_database_refuses_never_discards_the_other_paid_items(store, job, state_url):
    bad = {"surrogate-id": {"id": "x\ud800"}, "huge-count": {"prompt_tokens": 2**70}}
    if state_url.startswith("postgresql"):  # SQLite stores these; PostgreSQL refuses them (DataError)
        bad |= {"nul-tenant": {"tenant": "a\x00b"}, "long-tenant": {"tenant": "t" * 201}, "nul-id": {"id": "a\x00"}}
    items = {}
    for i, (key, fields) in enumerate(bad.items()):  # good and bad interleaved, as in one engine call
        items[f"good-{i}"] = make_item(f"good {i}", id=f"g{i}")
        items[key] = make_item("bad", **fields)
    items["good-last"] = make_item("good last", id="glast")
    store.store_items(job, {"good-0": make_item("first")})  # one key stored already (another worker)
    with pytest.raises(ItemsRefused) as e:
        store.store_items(job, items)
    assert set(e.value.refused) == set(bad)
    message = str(e.value)
    assert "\n" not in message and f"refused {len(bad)} of {len(items)} items" in message
    assert f"the other {len(items) - len(bad)} are stored and not paid again" in message
    assert "record 'x\\ud800'" in message and "UnicodeEncodeError" in message  # names the record and why
    got = store.stored_items(job, list(items))
    good = {k for k in items if k.startswith("good")}
    assert set(got) == good and got["good-0"]["summary"] == "first" and got["good-last"]["summary"] == "good last"
    assert all("\n" not in reason and len(reason) <= 300 for reason in e.value.refused.values())


# -- item 7: the database's clock, and holders that are provably gone ---------------------------------------


def test_leases_are_compared_on_the_database_clock_not_the_workers(store, job, monkeypatch):
    real_now = catalog.now
    epoch = store.claim(job, "p1", "w", lease_seconds=60)
    monkeypatch.setattr(catalog, "now", lambda: real_now() + timedelta(hours=1))  # a worker an hour ahead
    assert store.claim(job, "p1", "ahead", lease_seconds=60) is None  # the live lease is not its to take
    monkeypatch.setattr(catalog, "now", lambda: real_now() - timedelta(hours=1))  # and one an hour behind
    assert store.heartbeat(job, "p1", "w", 60, epoch)
    lease = aware(partition(store, job, "p1").lease_expires_at)
    assert abs((lease - store.db_now()).total_seconds() - 60) < 5  # extended from the database's now
    assert abs((store.db_now() - real_now()).total_seconds()) < 5  # (the test's database runs on this host)


def test_staging_is_reclaimed_on_the_database_clock(store, monkeypatch):
    """A worker whose clock runs an hour ahead must not take over a staging that just began."""
    real_now = catalog.now
    job_id = f"s-{uuid.uuid4().hex[:6]}"
    assert store.claim_planning(job_id, "fp", "in", "out")
    monkeypatch.setattr(catalog, "now", lambda: real_now() + timedelta(hours=1))
    assert not store.reclaim_planning(job_id, lease_seconds=60)
    store.set_job(job_id, status="planning_failed")
    assert store.reclaim_planning(job_id, lease_seconds=60)  # a failed staging is taken over at once


def test_a_holder_that_is_gone_is_released_and_a_live_one_is_not(store, job):
    host = socket.gethostname()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: no process has its pid now
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        holders = {"p1": f"{host}:{dead.pid}", "p2": f"{host}:{live.pid}", "p3": f"elsewhere:{dead.pid}"}
        for p, holder in holders.items():
            assert store.claim(job, p, holder, lease_seconds=300)
        assert [worker_is_gone(h) for h in holders.values()] == [True, False, False]  # another host: unprovable
        assert store.release_gone_holder(job, "p1", holders["p1"])
        assert not store.release_gone_holder(job, "p1", holders["p1"])  # released once; nothing left to end
        assert not store.release_gone_holder(job, "p2", "someone-else")  # only while that holder holds it
        assert store.claim(job, "p1", "taker", lease_seconds=300)  # at once, not 300 s later
        assert store.claim(job, "p2", "taker", lease_seconds=300) is None
    finally:
        live.kill()
        live.wait()


def test_a_rerun_takes_over_from_a_gone_holder_at_once_and_names_the_live_ones(state_url, tmp_path, caplog):
    """After `kill -9` a rerun waited out the dead worker's whole lease (300 s) saying nothing."""
    from pipeline.config import load_config
    from pipeline.errors import JobError
    from pipeline.job.commit import commit_partition, take_over_gone_holders
    from pipeline.job.context import JobContext
    from pipeline.stores.catalog import utc
    from tests.conftest import ONE_TIER, TINY_CONFIG

    config = load_config(
        TINY_CONFIG,
        environ={  # no engine runs here: no models needed; default lease, 300 s
            "TOKENMILL_HOME": str(tmp_path),
            "TOKENMILL_INPUT__URI": str(tmp_path / "in"),
            "TOKENMILL_OUTPUT__URI": str(tmp_path / "out"),
            "TOKENMILL_STATE__URL": state_url,
            **ONE_TIER,
        },
    )
    migrate(state_url)
    job = JobContext.open(config, f"held-{uuid.uuid4().hex[:6]}")
    state, host = job.state, socket.gethostname()
    assert state.claim_planning(job.job_id, "fp", "in", "out")
    state.add_partitions(job.job_id, {p: {"file": p, "records": 1} for p in ("p1", "p2", "p3")})
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        holders = {"p1": f"{host}:{dead.pid}", "p2": f"{host}:{live.pid}", "p3": f"other-host:{live.pid}"}
        for p, holder in holders.items():
            assert state.claim(job.job_id, p, holder, lease_seconds=300)
        announced: set[tuple] = set()
        with caplog.at_level(logging.INFO, logger="pipeline.job.commit"):
            assert take_over_gone_holders(state, job.job_id, state.partitions(job.job_id), announced)  # at once
            assert not take_over_gone_holders(state, job.job_id, state.partitions(job.job_id), announced)  # no more
        assert state.claim(job.job_id, "p1", job.worker, 300)
        text = caplog.text
        assert f"partition p1: its holder {holders['p1']} is gone" in text
        for p in ("p2", "p3"):
            expiry = utc(partition(state, job.job_id, p).lease_expires_at)
            assert f"partition {p} waits: held by worker {holders[p]}" in text and f"lease ends at {expiry}" in text
            assert text.count(f"partition {p} waits") == 1  # said once per holder and lease, not every second
        with pytest.raises(JobError, match=f"held by worker {holders['p2']} until its lease ends at 20"):
            commit_partition(job.committing(), "p2")
    finally:
        live.kill()
        live.wait()


def test_the_planning_lease_is_fenced_and_a_gone_planner_is_taken_over_at_once(store):
    """From the red-team round: the planning lease had no owner token (a retried planning task of an earlier
    attempt could still renew, fail or register the staging while another worker planned it again), and a
    dead planner was waited out for its whole lease (300 s) without a word."""
    job_id = f"pl-{uuid.uuid4().hex[:6]}"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = f"{socket.gethostname()}:{dead.pid}"
    assert store.claim_planning(job_id, "fp", "in", "out", worker=gone) == 1
    assert store.reclaim_planning(job_id, lease_seconds=300, worker="w2") is None  # its lease has not run out
    assert store.reclaim_planning(job_id, lease_seconds=300, worker="w2", gone_worker="someone-else") is None
    assert store.reclaim_planning(job_id, lease_seconds=300, worker="w2", gone_worker=gone) == 2  # at once
    row = store.job(job_id)
    assert (row.status, row.planning_worker, row.planning_epoch) == ("planning", "w2", 2)
    # The replaced planner (epoch 1) changes nothing any more.
    assert not store.renew_planning(job_id, 1) and not store.fail_planning(job_id, 1, "late failure")
    assert not store.register_partitions(job_id, 1, {"p1": {"file": "a", "records": 1}}, {"records": 1})
    assert store.job(job_id).status == "planning" and store.partitions(job_id) == []
    assert store.renew_planning(job_id, 2)
    assert store.register_partitions(job_id, 2, {"p1": {"file": "a", "records": 1}}, {"records": 1})
    assert store.job(job_id).status == "planned" and [p.partition for p in store.partitions(job_id)] == ["p1"]
    assert not store.fail_planning(job_id, 2, "a late step after planning")  # a planned job stays planned
