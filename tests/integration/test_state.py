"""The state catalog's contract, on SQLite and on a real PostgreSQL server."""

import json
import threading
import time
import uuid

import pytest

from pipeline.stores.catalog import StateError, StateStore


@pytest.fixture
def job(store):
    job_id = f"j-{uuid.uuid4().hex[:6]}"
    assert store.claim_planning(job_id, "fp", "in", "out")
    store.add_partitions(job_id, {"p1": {"file": "a", "records": 3}, "p2": {"file": "b", "records": 1}})
    return job_id


def test_staging_is_claimed_once(store, job):
    assert not store.claim_planning(job, "fp", "in", "out")


def test_claim_is_exclusive_under_contention(store, job):
    wins = []

    def worker(name):
        if store.claim(job, "p1", name, lease_seconds=60):
            wins.append(name)

    threads = [threading.Thread(target=worker, args=(f"w{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1
    (p1,) = [p for p in store.partitions(job) if p.partition == "p1"]
    assert p1.status == "running" and p1.worker == wins[0] and p1.attempts == 1


def lease_end(store, job_id, partition):
    from pipeline.stores.catalog import aware

    return aware(next(p for p in store.partitions(job_id) if p.partition == partition).lease_expires_at)


def run_out(store, job_id, partition) -> None:
    """Wait until the partition's lease has ended on the database's clock (the moment is made to happen by a
    short lease; the limit only guards against a hang)."""
    end, deadline = lease_end(store, job_id, partition), time.monotonic() + 60
    while store.db_now() <= end:
        assert time.monotonic() < deadline, "the database's clock never passed the lease's end"
        time.sleep(0.05)


def test_a_dead_workers_lease_expires_and_another_takes_over(store, job):
    dead = store.claim(job, "p1", "dead", lease_seconds=60)
    assert dead == 1
    assert store.claim(job, "p1", "alive", lease_seconds=30) is None  # still leased (for a minute)
    assert store.heartbeat(job, "p1", "dead", 0.2, dead)  # its last beat: the lease now ends in 0.2 s
    run_out(store, job, "p1")  # then the worker dies: no beat moves it again
    assert store.claim(job, "p1", "alive", lease_seconds=30) == 2  # a new epoch fences the old claim out
    assert not store.heartbeat(job, "p1", "dead", 30, dead)  # the old owner lost it and learns so
    # A late commit from the old owner is refused, and says so...
    assert not store.finish_partition(job, "p1", "dead", dead, "succeeded", counts={})
    (p1,) = [p for p in store.partitions(job) if p.partition == "p1"]
    assert p1.status == "running" and p1.worker == "alive" and p1.attempts == 2  # ...changes nothing


def test_heartbeat_keeps_the_lease_and_without_it_the_lease_expires(store, job):
    """Each beat sets the lease's end to the database's now + the lease, whenever it lands: bracketed by the
    database's clock read before and after it, so no timing window is assumed (a loaded machine only widens
    the bracket)."""
    epoch = store.claim(job, "p1", "w", lease_seconds=60)
    first = lease_end(store, job, "p1")
    for _ in range(3):
        before = store.db_now()
        assert store.heartbeat(job, "p1", "w", 60, epoch)
        after = store.db_now()
        end = lease_end(store, job, "p1")
        assert before.timestamp() + 60 <= end.timestamp() + 1e-3 and end.timestamp() <= after.timestamp() + 60 + 1e-3
        assert not store.claim(job, "p1", "other", lease_seconds=30)  # held: the lease has not ended
    assert lease_end(store, job, "p1") >= first
    assert store.heartbeat(job, "p1", "w", 0.2, epoch)  # a last beat, then none: the lease runs out
    run_out(store, job, "p1")
    assert store.claim(job, "p1", "other", lease_seconds=30) == epoch + 1
    assert not store.heartbeat(job, "p1", "w", 0.6, epoch)  # the old holder's beat no longer extends anything


def test_a_heartbeat_that_finds_its_lease_taken_sets_lost(store, job):
    """Renewal.lost is what keeps a worker whose lease was taken over from committing."""
    from sqlalchemy import update

    from pipeline.stores.catalog import Partition
    from pipeline.stores.lease import Renewal

    epoch = store.claim(job, "p1", "w", lease_seconds=1.5)  # a beat every 0.5 s
    claimed_end = lease_end(store, job, "p1")
    with Renewal(lambda: store.heartbeat(job, "p1", "w", 1.5, epoch), 1.5, "lease-p1") as beat:
        deadline = time.monotonic() + 30  # a guard against a hang: the beat is waited for, not timed
        while lease_end(store, job, "p1") <= claimed_end and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not beat.lost and lease_end(store, job, "p1") > claimed_end  # a beat landed
        # Another worker takes it over between two beats, as a claim after this worker stalled past its
        # lease would (one UPDATE: a beat landing between an expiry and a claim would extend the lease).
        with store.db_session() as s, s.begin():
            s.execute(
                update(Partition)
                .where(Partition.job_id == job, Partition.partition == "p1")
                .values(worker="other", epoch=Partition.epoch + 1)
            )
        deadline = time.monotonic() + 30
        while not beat.lost and time.monotonic() < deadline:
            time.sleep(0.05)
        assert beat.lost
    (p1,) = [p for p in store.partitions(job) if p.partition == "p1"]
    assert p1.worker == "other" and p1.epoch == epoch + 1  # the lost heartbeat took nothing back


def test_succeeded_partitions_are_claimed_only_when_forced(store, job):
    epoch = store.claim(job, "p2", "w", 30)
    assert store.finish_partition(job, "p2", "w", epoch, "succeeded", counts={"outputs": 1})
    assert store.claim(job, "p2", "w", 30) is None
    assert store.claim(job, "p2", "w", 30, force=True) == epoch + 1


def test_the_same_worker_name_is_fenced_by_its_epoch(store, job):
    """A restarted worker may reuse a name (host:pid); the epoch still tells its claims apart."""
    first = store.claim(job, "p1", "w", lease_seconds=0.3)
    run_out(store, job, "p1")
    second = store.claim(job, "p1", "w", lease_seconds=30)
    assert second == first + 1
    assert not store.finish_partition(job, "p1", "w", first, "failed", error="stale")
    assert store.finish_partition(job, "p1", "w", second, "succeeded", counts={})
    (p1,) = [p for p in store.partitions(job) if p.partition == "p1"]
    assert p1.status == "succeeded" and p1.last_error is None


def test_items_keep_the_first_stored_value(store, job):
    from tests.integration.test_catalog_races import make_item as item

    store.store_items(job, {"k1": item("first")})
    store.store_items(job, {"k1": item("second"), "k2": item("other")})
    got = store.stored_items(job, ["k1", "k2", "missing"])
    assert got["k1"]["summary"] == "first" and set(got) == {"k1", "k2"}


def test_unreachable_database_is_a_clear_error_without_password():
    with pytest.raises(StateError) as e:
        StateStore("postgresql+psycopg://tokenmill:hunter2@127.0.0.1:1/nowhere")
    message = str(e.value)
    assert "unreachable" in message and "127.0.0.1:1/nowhere" in message and "hunter2" not in message


def _open_the_catalog(url: str, barrier) -> None:
    """One worker process: migrate and open the catalog the moment every worker is ready (a child of the fork
    below)."""
    from pipeline.stores.catalog import StateStore, migrate

    barrier.wait(60)
    migrate(url)
    StateStore(url).jobs()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_workers_starting_together_on_a_fresh_catalog_all_get_it(backend, tmp_path, request):
    """Several processes creating the schema at once: one migrates, the others wait and find it current.
    They are forked with the catalog imported and released together by a barrier, so they do start at
    once (separate interpreters would be staggered by their imports) and cost no import each."""
    import multiprocessing

    from sqlalchemy import create_engine

    import pipeline.stores.catalog  # noqa: F401 (imported before the fork: the children have it)

    url = f"sqlite:///{tmp_path}/fresh.db" if backend == "sqlite" else request.getfixturevalue("fresh_postgres_url")
    create_engine(url).dispose()  # imports the database driver before the fork too (connects nowhere)
    fork = multiprocessing.get_context("fork")
    barrier = fork.Barrier(6)
    procs = [fork.Process(target=_open_the_catalog, args=(url, barrier)) for _ in range(6)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        assert [p.exitcode for p in procs] == [0] * 6  # a failing child's traceback is in the captured stderr
    finally:
        for p in procs:  # a child that hung: gone, with its database connection
            if p.is_alive():
                p.kill()
                p.join()


def test_catalog_items_table_stores_every_field_of_the_item_type():
    """schema.ITEM is the one item type: the catalog's items table has exactly its fields, in order."""
    from pipeline.schema import ITEM
    from pipeline.stores.catalog import Item

    assert [c.name for c in Item.__table__.columns] == ["job_id", "item_key", *ITEM.names]


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_migration_0019_renames_the_planning_statuses_and_its_holder_column(backend, tmp_path, request):
    """A catalog planned under the old names (statuses staging | staging_failed | staged, column `planner`)
    reads under the one name, planning, after the upgrade; and back again after a downgrade."""
    from alembic import command
    from sqlalchemy import create_engine, text

    from pipeline.stores.catalog import alembic_config

    url = f"sqlite:///{tmp_path}/old.db" if backend == "sqlite" else request.getfixturevalue("fresh_postgres_url")
    cfg = alembic_config(url)
    command.upgrade(cfg, "0018")
    engine = create_engine(url)
    insert = text(
        "INSERT INTO jobs (job_id, status, config_fingerprint, input_uri, output_uri, created_at, planner, "
        "planning_epoch) VALUES (:job, :status, 'fp', 'in', 'out', CURRENT_TIMESTAMP, 'host:1', 1)"
    )
    old = {"a": "staging", "b": "staging_failed", "c": "staged", "d": "succeeded"}
    with engine.begin() as c:
        for job, status in old.items():
            c.execute(insert, {"job": job, "status": status})
    command.upgrade(cfg, "head")
    store = StateStore(url)
    assert {j.job_id: (j.status, j.planning_worker) for j in store.jobs()} == {
        "a": ("planning", "host:1"),
        "b": ("planning_failed", "host:1"),
        "c": ("planned", "host:1"),
        "d": ("succeeded", "host:1"),
    }
    command.downgrade(cfg, "0018")
    with engine.connect() as c:
        assert dict(c.execute(text("SELECT job_id, status FROM jobs")).all()) == old
        assert set(c.execute(text("SELECT planner FROM jobs")).scalars()) == {"host:1"}
    engine.dispose()


def test_opening_the_catalog_or_reading_it_never_migrates(tmp_path):
    """Migrations run once per process, by what writes (`tokenmill migrate`, a job, `serve`, the DAG's first
    task): opening a StateStore creates no table, and a command that only reads says to migrate instead."""
    from sqlalchemy import create_engine, inspect
    from typer.testing import CliRunner

    from pipeline.cli import app
    from tests.conftest import TINY_CONFIG

    url = f"sqlite:///{tmp_path}/fresh.db"
    assert not StateStore(url).has_schema()
    cli = CliRunner(env={"TOKENMILL_HOME": str(tmp_path), "TOKENMILL_STATE__URL": url})
    listed = cli.invoke(app, ["jobs", "list", "--config", str(TINY_CONFIG)])
    assert listed.exit_code != 0 and "tokenmill migrate" in listed.output
    assert inspect(create_engine(url)).get_table_names() == []
    migrated = cli.invoke(app, ["migrate", "--config", str(TINY_CONFIG)])
    assert migrated.exit_code == 0, migrated.output
    assert (
        StateStore(url).has_schema() and cli.invoke(app, ["jobs", "list", "--config", str(TINY_CONFIG)]).exit_code == 0
    )


def test_a_finished_unit_finds_the_partitions_waiting_on_other_partitions_keys(store, job):
    """A partition whose wave waits on keys another partition's unit owns has no open unit of its own: the
    unit that finishes those keys advances it (TierDrain.unit_done), so the drain's question changes nothing."""
    from sqlalchemy import update

    from pipeline.stores.catalog import Partition
    from pipeline.stores.units import UnitQueue, WorkUnit

    queue = UnitQueue(store)
    with store.db_session() as s, s.begin():
        s.execute(update(Partition).where(Partition.job_id == job).values(generation="generating", wave=0))
    assert queue.enqueue(job, "p1", 0, {"small": ["k1"]}) == {"p1/0/small": ["k1"]}
    assert queue.enqueue(job, "p2", 0, {"small": ["k1"]}) == {"p2/0/small": []}  # p1 owns k1: p2 has no unit
    assert queue.partitions_without_open_units(job) == ["p2"]
    with store.db_session() as s, s.begin():
        s.execute(update(WorkUnit).where(WorkUnit.job_id == job).values(status="done"))
    assert queue.partitions_without_open_units(job) == ["p1", "p2"]


def _killed_while_migrating(url: str, statements: int) -> None:
    """A worker killed (SIGKILL: no handler, no rollback of its own) after its first `statements` CREATE TABLEs."""
    import os
    import signal

    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    from pipeline.stores.catalog import upgrade_schema

    created = []

    def after(conn, cursor, statement, parameters, context, executemany):
        if statement.lstrip().upper().startswith("CREATE TABLE"):
            created.append(statement)
            if len(created) == statements:
                os.kill(os.getpid(), signal.SIGKILL)

    event.listen(Engine, "after_cursor_execute", after)
    upgrade_schema(url)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_first_migration_killed_midway_leaves_nothing_and_the_next_run_migrates(backend, tmp_path, request):
    """The first run's worker dies inside the first migration (Alembic's version table and `jobs` made, the
    rest not): the catalog keeps no half schema, and the next run creates the whole of it, as on a database
    never touched. (SQLite's driver commits DDL as it goes unless told to open the transaction itself.)"""
    import multiprocessing

    from sqlalchemy import create_engine, inspect

    from pipeline.stores.catalog import upgrade_schema

    url = f"sqlite:///{tmp_path}/fresh.db" if backend == "sqlite" else request.getfixturevalue("fresh_postgres_url")
    killed = multiprocessing.get_context("fork").Process(target=_killed_while_migrating, args=(url, 2))
    killed.start()
    killed.join(120)
    assert killed.exitcode == -9
    engine = create_engine(url)
    try:
        assert inspect(engine).get_table_names() == []  # all of it or none of it
        upgrade_schema(url)
        reference = create_engine(f"sqlite:///{tmp_path}/reference.db")
        upgrade_schema(str(reference.url))
        tables = sorted(inspect(engine).get_table_names())
        assert tables == sorted(inspect(reference).get_table_names()) and "alembic_version" in tables
        with engine.connect() as c:
            assert c.exec_driver_sql("SELECT count(*) FROM jobs").scalar_one() == 0
        assert StateStore(url).jobs() == []
    finally:
        engine.dispose()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_migration_0020_moves_control_data_out_of_counts_into_columns(backend, tmp_path, request):
    """A catalog whose rows kept control data in `counts` (a job's isolation fingerprint and batch files under
    `staging`, a partition's commit record and metrics figures) has it in columns after the upgrade, `counts`
    keeping the figures; and in `counts` again after a downgrade."""
    from alembic import command
    from sqlalchemy import create_engine, text

    from pipeline.stores.catalog import alembic_config

    url = f"sqlite:///{tmp_path}/old.db" if backend == "sqlite" else request.getfixturevalue("fresh_postgres_url")
    cfg = alembic_config(url)
    command.upgrade(cfg, "0019")
    engine = create_engine(url)
    job_counts = {"records": 2, "staging": {"records": 2, "isolation": "iso", "batch_files": {"a.jsonl": "openai"}}}
    figures = {"items": {"t": {"small": {"generated": 1}}}}
    commit = {"id": "1-abc", "epoch": 1, "files": {"outputs": ["outputs/x.parquet"]}}
    part_counts = {"outputs": 1, "commit": commit, "metrics": figures}
    with engine.begin() as c:
        c.execute(
            text(
                "INSERT INTO jobs (job_id, status, config_fingerprint, input_uri, output_uri, created_at, counts, "
                "planning_epoch) VALUES ('j', 'planned', 'fp', 'in', 'out', CURRENT_TIMESTAMP, :counts, 1)"
            ),
            {"counts": json.dumps(job_counts)},
        )
        insert = text(
            "INSERT INTO partitions (job_id, partition, file, records, status, attempts, epoch, counts, wave) "
            "VALUES ('j', :p, 'f', 1, :status, 1, 1, :counts, 0)"
        )
        c.execute(insert, {"p": "p1", "status": "succeeded", "counts": json.dumps(part_counts)})
        c.execute(insert, {"p": "p2", "status": "pending", "counts": None})
    command.upgrade(cfg, "head")
    store = StateStore(url)
    job = store.job("j")
    assert (job.isolation, job.batch_files) == ("iso", {"a.jsonl": "openai"})
    assert json.loads(job.counts) == {"records": 2, "staging": {"records": 2}}
    p1, p2 = store.partitions("j")
    assert (p1.commit_id, p1.commit_epoch, p1.commit_files, p1.figures) == ("1-abc", 1, commit["files"], figures)
    assert json.loads(p1.counts) == {"outputs": 1}
    assert (p2.commit_id, p2.commit_epoch, p2.commit_files, p2.figures, p2.counts) == (None,) * 5
    command.downgrade(cfg, "0019")
    with engine.connect() as c:
        assert json.loads(c.execute(text("SELECT counts FROM jobs")).scalar_one()) == job_counts
        counts = dict(c.execute(text("SELECT partition, counts FROM partitions")).all())
        assert json.loads(counts["p1"]) == part_counts and counts["p2"] is None
    engine.dispose()
