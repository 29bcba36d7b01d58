"""Tier workers in one process (`tokenmill run`): each tier's engine started once, every record accounted
once, the ledger adding up to every GPU-second held, a failing partition alone, and its rerun paying
nothing twice. Plus the work-unit queue on SQLite and PostgreSQL: leases, takeover, cross-partition keys."""

import sqlite3
import uuid
from datetime import timedelta

import pyarrow.compute as pc
import pytest
from sqlalchemy import update

from pipeline import run_job
from pipeline.dev.samples import write_sample_corpus
from pipeline.generate.engine import EnginePool
from pipeline.job import faults
from pipeline.stores.catalog import StateStore, migrate
from pipeline.stores.units import EngineSession, UnitQueue, WorkUnit
from tests.conftest import read_kind
from tests.engines import OneCallEngine
from tests.jobs import assert_exactly_once


def held_gpu_seconds(db, job_id: str) -> float:
    with sqlite3.connect(db) as c:
        return c.execute(
            "select sum((startup_seconds + busy_seconds + idle_seconds) * gpus) from engine_sessions where job_id=?",
            (job_id,),
        ).fetchone()[0]


def test_one_process_runs_tier_workers_fed_from_every_partition(make_config, tmp_path):
    corpus = write_sample_corpus(tmp_path / "input", documents=48)
    config = make_config(routing=True, input__records_per_partition=6)
    pool = EnginePool(config.tiers)  # no engine left by an earlier test (conftest): this job starts its own
    seen = []

    def fail_one(point, job_id, partition):
        if point == "before_generate":
            seen.append(partition)
            if len(seen) == 4:  # the fourth partition prepared
                raise OSError("CPU worker lost")

    with faults.inject(fail_one), pytest.raises(Exception, match="1 of"):
        run_job(config, job_id="tw", pool=pool, release_engines=True)
    victim = seen[3]
    state = StateStore(config.state.url)
    parts = {p.partition: p for p in state.partitions("tw")}
    assert len(parts) >= 8 and parts[victim].status == "failed" and "CPU worker lost" in parts[victim].last_error
    assert all(p.status == "succeeded" for name, p in parts.items() if name != victim)

    db = tmp_path / "state.db"
    sessions = UnitQueue(state).sessions("tw")
    # One worker per tier, each engine started once, fed from every partition it had work for.
    assert sorted(s.tier for s in sessions) == ["large", "small"] and all(s.started == 1 for s in sessions)
    with sqlite3.connect(db) as c:
        fed = dict(c.execute("select tier, count(distinct partition) from work_units where job_id='tw' group by tier"))
    assert fed["small"] >= 6, fed
    before = read_kind(tmp_path / "output", "ledger", "tw")
    assert pc.sum(before["gpu_seconds"]).as_py() == pytest.approx(held_gpu_seconds(db, "tw"), rel=1e-6)
    assert pc.sum(before["overhead_gpu_seconds"]).as_py() > 0  # start-up and idle are billed, not dropped

    # Ops re-run exactly the failed partition: only its work is done, nothing paid twice.
    m = run_job(config, job_id="tw", pool=pool, partitions=[victim], release_engines=True).manifest.as_json()
    assert m["status"] == "succeeded"
    after = read_kind(tmp_path / "output", "ledger", "tw")
    others = lambda t: t.filter(pc.not_equal(t["partition"], victim)).sort_by("id").to_pylist()  # noqa: E731
    assert others(after) == others(before), "committed partitions are not touched again"
    assert_exactly_once(tmp_path / "output", "tw", corpus, db)
    for e in m["engines"].values():
        assert e["held_seconds"] == pytest.approx(e["startup_seconds"] + e["busy_seconds"] + e["idle_seconds"])
        assert 0 < e["utilisation"] <= 1 and e["starts"] == e["workers"]


def test_unit_queue_leases_and_takeover(tmp_path, postgres_url):
    for url in (f"sqlite:///{tmp_path}/q.db", postgres_url):
        migrate(url)
        q = UnitQueue(StateStore(url))
        job = f"q-{uuid.uuid4().hex}"
        owned = q.enqueue(job, "p1", 0, {"small": ["k1", "k2"], "large": ["k3"]})
        assert owned == {"p1/0/small": ["k1", "k2"], "p1/0/large": ["k3"]}
        # Another partition asking for k2 at the same moment waits for p1's unit instead of paying again.
        assert q.enqueue(job, "p2", 0, {"small": ["k2", "k4"]}) == {"p2/0/small": ["k4"]}
        a = q.claim(job, "small", "w1", "s1", lease_seconds=60)
        b = q.claim(job, "small", "w2", "s2", lease_seconds=60)
        assert {a.unit_id, b.unit_id} == {"p1/0/small", "p2/0/small"}
        assert q.claim(job, "small", "w3", "s3", lease_seconds=60) is None  # both leased
        # w1's lease runs out (it died): w3 takes the unit over and the unit remembers whose it was.
        q.renew(job, "s1", lease_seconds=-5)
        taken = q.claim(job, "small", "w3", "s3", lease_seconds=60)
        assert taken.unit_id == a.unit_id
        assert [c.unit_id for c in q.unfinished_claims(job, "s1")] == [a.unit_id]  # the claim s1 lost
        assert not q.finish(job, a), "the dead worker's late finish is fenced out"
        assert q.finish(job, taken)
        q.set_keys(job, {"k1": ("done", None, None), "k2": ("failed", "engine_error", "boom")})
        # A failed key belongs to whoever tries it again.
        assert q.enqueue(job, "p2", 1, {"small": ["k2"]}) == {"p2/1/small": ["k2"]}
        assert q.depth(job)["small"]["pending"] == 1
        # ... even the unit that ran it: p1 prepared again makes its done unit pending again for k2.
        q.set_keys(job, {"k2": ("failed", "engine_error", "boom")})
        assert q.withdraw(job, "p1") == 1  # p1/0/large, never claimed
        assert q.enqueue(job, "p1", 0, {"small": ["k1", "k2"]}) == {"p1/0/small": ["k2"]}  # k1 is done
        assert [u.status for u in q.units(job, "p1") if u.tier == "small"] == ["pending"]
        # A key whose owner was withdrawn is free for the partition still waiting on it.
        q.enqueue(job, "p3", 0, {"large": ["k9"]})
        q.enqueue(job, "p4", 0, {"large": ["k9"]})
        q.withdraw(job, "p3")
        assert q.enqueue(job, "p4", 0, {"large": ["k9"]}) == {"p4/0/large": ["k9"]}
        # Deferred, withdrawn and enqueued again (a rerun under a higher cap): a new claim, never an old epoch.
        deferred = q.claim(job, "large", "w5", "s5", lease_seconds=60)
        assert q.finish(job, deferred, "deferred") and q.withdraw(job, "p4") == 1
        q.enqueue(job, "p4", 0, {"large": ["k9"]})
        again = q.claim(job, "large", "w6", "s6", lease_seconds=60)
        assert again.unit_id == deferred.unit_id and again.epoch == deferred.epoch + 1


def test_ending_a_partition_withdraws_the_units_of_its_dead_workers_too(tmp_path, postgres_url):
    """A partition ended where it stands (its job stopped for good) withdrew only the units no worker had
    claimed: one leased by a killed worker stayed `leased`, to be claimed (an engine started for it) once its
    lease ran out. Now a unit whose worker is provably gone, or whose lease ran out, goes too; a live worker's
    unit finishes."""
    import os
    import socket
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: no process has its pid now
    killed, live = f"{socket.gethostname()}:{dead.pid}", f"{socket.gethostname()}:{os.getpid()}"
    for url in (f"sqlite:///{tmp_path}/w.db", postgres_url):
        migrate(url)
        q = UnitQueue(StateStore(url))
        job = f"w-{uuid.uuid4().hex}"
        q.enqueue(job, "p1", 0, {"small": ["k1"], "large": ["k2"], "xl": ["k3"]})
        held = {t: q.claim(job, t, w, f"s-{t}", lease_seconds=60) for t, w in (("small", killed), ("large", live))}
        q.claim(job, "xl", live, "s-xl", lease_seconds=-5)  # its lease already ran out
        assert q.withdraw(job, "p1") == 0, "preparing it again leaves a dead worker's units to the drain"
        assert q.withdraw(job, "p1", dead_too=True) == 2
        assert [(u.unit_id, u.status) for u in q.units(job, "p1")] == [("p1/0/large", "leased")]
        assert [c.unit_id for c in q.unfinished_claims(job, "s-small")] == ["p1/0/small"], "its lost work is charged"
        assert not q.finish(job, held["small"]) and q.finish(job, held["large"])
        assert q.enqueue(job, "p2", 0, {"small": ["k1"], "xl": ["k3"]}) == {"p2/0/small": ["k1"], "p2/0/xl": ["k3"]}


class SlowFailingEngine(OneCallEngine):
    """A stand-in engine (generate only: the tier worker batches its steps): 20 ms per call, and a
    prompt holding the POISON token ids fails even alone, after taking its share of engine time."""

    poison: list[int] = []

    def __init__(self, tier):
        pass

    def generate(self, prompts, max_tokens, sampling):
        import time

        from pipeline.generate.engine_api import Completion

        time.sleep(0.02)
        if any(self.poison and str(self.poison)[1:-1] in str(p) for p in prompts):
            raise RuntimeError("simulated CUDA error on this item")
        return [Completion("a summary.", len(p), 0, 3, "stop") for p in prompts]


def test_failed_attempts_are_billed_in_the_ledger_and_it_adds_up_to_held(make_config, tmp_path):
    import json

    input_dir = tmp_path / "input"
    input_dir.mkdir()
    docs = [{"id": f"d{i}", "text": f"report {i} on quarterly revenue and delivery"} for i in range(12)]
    docs[5]["text"] = "POISON document that breaks the engine"
    (input_dir / "a.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    config = make_config()
    pool = EnginePool(config.tiers, factory=SlowFailingEngine)
    SlowFailingEngine.poison = pool.tokenizer("small")("POISON", add_special_tokens=False)["input_ids"]
    m = run_job(config, job_id="fail", pool=pool, release_engines=True).manifest.as_json()
    ledger = read_kind(tmp_path / "output", "ledger", "fail")
    failed = [r for r in ledger.to_pylist() if r["kind"] == "failed_attempt"]
    assert [r["id"] for r in failed] == ["d5"] and failed[0]["busy_gpu_seconds"] > 0 and failed[0]["tenant"]
    assert m["counts"]["outputs"] == 11 and m["counts"]["by_reason"] == {"engine_error": 1}
    assert pc.sum(ledger["gpu_seconds"]).as_py() == pytest.approx(
        held_gpu_seconds(tmp_path / "state.db", "fail"), rel=1e-6
    )
    assert m["cost"]["gpu_seconds_by_kind"]["failed_attempt"] == pytest.approx(failed[0]["gpu_seconds"])


def test_a_tier_without_max_num_seqs_fills_to_the_engines_default(make_config, tmp_path):
    """`tiers.<t>.vllm.max_num_seqs` unset (vLLM picks it): the worker keeps twice vLLM's default in flight."""
    import json

    from pipeline.generate.worker import batch_size

    (tmp_path / "input").mkdir()
    (tmp_path / "input" / "a.jsonl").write_text(
        "".join(json.dumps({"id": f"d{i}", "text": f"note {i} on sales"}) + "\n" for i in range(5))
    )
    config = make_config(tiers__small__vllm__max_num_seqs=None)
    assert config.tiers["small"].vllm.max_num_seqs is None
    m = run_job(config, job_id="unset", pool=EnginePool(config.tiers, factory=SlowFailingEngine)).manifest.as_json()
    assert m["status"] == "succeeded" and m["counts"]["outputs"] == 5
    assert batch_size(SlowFailingEngine(None), None) == 256 and batch_size(SlowFailingEngine(None), 8) == 8


def test_work_lost_with_dead_sessions_is_charged_once_whatever_the_order_of_takeovers(make_config, tmp_path):
    """Reproducer: a unit remembered only the last session it was taken from, and a dead session's lost work
    was shared over the units taken from it *so far*: a partition committing before the dead session's
    other unit was taken over was charged all of it, and the other partition, after a second takeover
    of the first unit, all of it again."""
    from pipeline.generate.engine_time import EngineTime

    config = make_config(state__lease_seconds=30)
    state = StateStore(config.state.url)
    q, job = UnitQueue(state), "lost"
    state.claim_planning(job, "fp", "in", "out")
    q.enqueue(job, "p1", 0, {"small": ["k1"]})
    q.enqueue(job, "p2", 0, {"small": ["k2"]})
    q.open_session("s1", job, "small", "dead-host:1", 1, True, 0.0, 0.0)
    assert {q.claim(job, "small", "dead-host:1", "s1", 30).unit_id for _ in range(2)} == {"p1/0/small", "p2/0/small"}
    q.beat_session("s1", busy=10.0, idle=0.0, recorded=0.0)  # 10 busy seconds, nothing stored: then it died
    times = EngineTime(config, job, state, q)

    def lost_rows(partition):
        shares = times.shares()
        return {r["session_id"]: r["busy_gpu_seconds"] for r in times.charges(partition, shares) if r["kind"] == "lost"}

    def take_over(unit_id, sid):
        with state.db_session() as s, s.begin():  # this unit's lease has run out (the other's not yet)
            s.execute(
                update(WorkUnit)
                .where(WorkUnit.job_id == job, WorkUnit.unit_id == unit_id)
                .values(lease_expires_at=state.db_now() - timedelta(seconds=1))
            )
        q.open_session(sid, job, "small", f"w-{sid}", 1, False, 0.0, 0.0)
        assert q.claim(job, "small", f"w-{sid}", sid, 30).unit_id == unit_id

    with state.db_session() as s, s.begin():  # s1's renewal is over a lease old: it is stale, its work lost
        s.execute(
            update(EngineSession)
            .where(EngineSession.session_id == "s1")
            .values(heartbeat_at=state.db_now() - timedelta(seconds=60))
        )
    take_over("p1/0/small", "s2")
    charged = {"p1": lost_rows("p1")}  # p1 commits now: p2's unit is still s1's
    take_over("p2/0/small", "s3")
    take_over("p1/0/small", "s4")  # a second takeover of p1's unit
    charged["p2"] = lost_rows("p2")
    assert charged == {"p1": {"s1": pytest.approx(5.0)}, "p2": {"s1": pytest.approx(5.0)}}


ESCALATE_ALL = dict(routing=True, route__escalation__min_mean_logprob=0.0, route__rules=[], dedup__near=False)


def race_at_wave_one(config, second, first=None) -> tuple[dict, list[str]]:
    """Run job `race`; at the first partition (with work) whose wave 1 is derived and written but not yet taken
    by the catalog, call `second(partition)`: another worker deriving the same wave. `first()` runs once, when
    the job's first wave 0 is written (before its drain). Returns the manifest and [the raced partition]."""
    written: dict[str, int] = {}
    raced: list[str] = []

    def race(point, job_id, partition):
        if point != "wave_written" or job_id != "race":
            return
        written[partition] = written.get(partition, 0) + 1
        if first is not None and not written.get("first"):
            written["first"] = 1
            first()
        generated = UnitQueue(StateStore(config.state.url)).units("race", partition)  # (not the all-bad partition)
        if written[partition] == 2 and generated and not raced:
            raced.append(partition)
            second(partition)

    with faults.inject(race):
        m = run_job(config, job_id="race").manifest.as_json()
    return m, raced


def test_workers_deriving_one_wave_at_once_enqueue_only_the_wave_that_stands(make_config, sample_corpus, tmp_path):
    """Reproducer: two workers derive a partition's next wave at once, one before the reuse cache
    has its escalations (so they are to run), the other after (cache hits, stored: nothing to run). Both
    wrote the same file names and both enqueued their keys, so the large tier ran escalations the job already
    had: paid for nothing. Now each derivation writes files of its own, the catalog takes one, and only its
    taker enqueues."""
    from pipeline.job.context import JobContext

    config = make_config(**ESCALATE_ALL)

    def second(partition):
        run_job(config, job_id="warm")  # another job caches every escalation meanwhile
        JobContext.open(config, "race").waves.advance(partition)  # a second worker derives the wave: cache hits

    m, raced = race_at_wave_one(config, second)
    assert m["status"] == "succeeded" and raced
    with sqlite3.connect(tmp_path / "state.db") as c:
        followups = c.execute(
            "select count(*) from work_units where job_id='race' and partition=? and wave > 0", raced
        ).fetchone()[0]
        origins = {
            o
            for (o,) in c.execute(
                "select origin from items where job_id='race' and partition=? and tier='large'", raced
            )
        }
    assert followups == 0, "the losing derivation's escalations were enqueued"
    assert origins == {"cache"}  # the partition's escalations are the cache's, none paid again
    assert_exactly_once(tmp_path / "output", "race", sample_corpus[1], tmp_path / "state.db")


def test_a_derivation_that_lost_its_race_stores_nothing(make_config, sample_corpus, tmp_path):
    """The other order: the worker that found the escalations in the cache loses the race to one that could
    not reach the cache and enqueued them to run. It stored its cache hits before its compare-and-set, so the
    wave that stood was half another derivation's. Now the loser stores nothing: the partition's escalations
    are the standing wave's, generated and paid once, and the ledger still adds up."""
    from pipeline.job.context import JobContext

    config, no_cache = make_config(**ESCALATE_ALL), make_config(**ESCALATE_ALL, cache__enabled=False)
    m, raced = race_at_wave_one(
        config,
        lambda partition: JobContext.open(no_cache, "race").waves.advance(partition),
        first=lambda: run_job(config, job_id="warm"),
    )  # every escalation cached first
    assert m["status"] == "succeeded" and raced
    with sqlite3.connect(tmp_path / "state.db") as c:
        units = c.execute(
            "select count(*) from work_units where job_id='race' and partition=? and wave = 1", raced
        ).fetchone()[0]
        origins = [
            o
            for (o,) in c.execute(
                "select origin from items where job_id='race' and partition=? and tier='large'", raced
            )
        ]
    assert units > 0, "the winner's escalations were enqueued"
    assert origins and set(origins) == {None}, "the losing derivation stored its cache hits"
    assert_exactly_once(tmp_path / "output", "race", sample_corpus[1], tmp_path / "state.db")
    ledger = read_kind(tmp_path / "output", "ledger", "race")
    assert pc.sum(ledger["gpu_seconds"]).as_py() == pytest.approx(held_gpu_seconds(tmp_path / "state.db", "race"))


def test_a_session_that_generated_nothing_is_charged_once_whole(make_config, tmp_path):
    """Reproducer (a flake of the two-workers test, seen once in CI): the second worker started its engine for
    a unit the first then took. Its session stored nothing, so its held time was shared over every partition,
    and the partitions that had committed before it began never carried their part: ledger < held. Now the
    first partition that commits after it ended takes it whole, once."""
    from pipeline.generate.engine_time import EngineTime

    config = make_config()
    state = StateStore(config.state.url)
    q, job = UnitQueue(state), "unused"
    state.claim_planning(job, "fp", "in", "out")
    state.add_partitions(job, {"p1": {"file": "a", "records": 3}, "p2": {"file": "b", "records": 3}})
    times = EngineTime(config, job, state, q)

    def unused_rows(partition):
        return [r for r in times.charges(partition, times.shares()) if r["kind"] == "lost"]

    assert unused_rows("p1") == []  # p1 commits before the second worker's engine started
    q.open_session("late", job, "small", "w2", 1, True, startup_seconds=0.4, idle_seconds=0.0)
    q.beat_session("late", busy=0.0, idle=0.1, recorded=0.0, closed=True)  # it found no unit left
    rows = unused_rows("p2")
    assert [(r["session_id"], r["busy_gpu_seconds"]) for r in rows] == [("late", pytest.approx(0.5))]
    assert unused_rows("p1") == [] and len(unused_rows("p2")) == 1  # a commit again: still once, in p2
