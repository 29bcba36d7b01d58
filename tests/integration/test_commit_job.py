"""Commits of whole jobs (fake engine): a stale worker is fenced out, and record ids round-trip byte for byte."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from pipeline import run_job
from pipeline.dev.samples import write_sample_corpus
from pipeline.output.ledger import connect
from pipeline.stores.catalog import StateStore
from tests.conftest import REPO, TINY_CONFIG, read_kind
from tests.jobs import cli_env

PAUSED_WORKER = """
import os, signal, sys
from pathlib import Path
from pipeline import JobError, load_config, run_job
from pipeline.job import faults

marker = Path(sys.argv[2])

def pause(point, job_id, partition):
    # Outputs assembled, nothing written: stop here, as a GC pause or a frozen VM would.
    if point == "before_commit" and not marker.exists():
        marker.write_text(partition)
        os.kill(os.getpid(), signal.SIGSTOP)

with faults.inject(pause):
    try:
        run_job(load_config(sys.argv[1]), job_id="fenced")
    except JobError as e:
        print("job error:", e)
"""


def test_a_worker_stopped_past_its_lease_commits_nothing(make_config, tiny_models, tmp_path):
    counts = write_sample_corpus(tmp_path / "input", documents=24)
    env = cli_env(tiny_models, tmp_path, run__progress="off", state__lease_seconds=3, state__wait_seconds=0.2)
    marker = tmp_path / "paused"
    stale = subprocess.Popen(
        [sys.executable, "-c", PAUSED_WORKER, str(TINY_CONFIG), str(marker)],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 300
        while not marker.exists() and stale.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert marker.exists(), stale.communicate()[1][-2000:]
        victim = marker.read_text()
        time.sleep(4)  # past the stopped worker's lease: its heartbeat is stopped with it

        # Another worker takes the partition over and finishes the job.
        config = make_config(state__lease_seconds=3, state__wait_seconds=0.2)
        run_job(config, job_id="fenced")
    finally:
        os.kill(stale.pid, signal.SIGCONT)
    out, err = stale.communicate(timeout=300)
    assert stale.returncode == 0, err[-2000:]
    assert "lease lost" in err and victim in err  # the stale worker says what happened

    state = StateStore(config.state.url)
    (part,) = [p for p in state.partitions("fenced") if p.partition == victim]
    assert part.status == "succeeded" and part.epoch == 2  # committed by the second claim only
    con = connect(str(tmp_path / "output"))
    ids = [r[0] for r in con.execute("SELECT id FROM outputs").fetchall()]
    quarantined = con.execute("SELECT count(*) FROM quarantine").fetchone()[0]
    assert len(ids) == len(set(ids)) and len(ids) + quarantined == counts["documents"] + counts["bad_records"]
    # One charge: the ledger holds what the catalog's items cost, once.
    ledger_busy = con.execute("SELECT sum(busy_gpu_seconds) FROM ledger").fetchone()[0]
    with state.session() as s:
        from sqlalchemy import func, select

        from pipeline.stores.catalog import Item

        items_gpu = s.execute(select(func.sum(Item.gpu_seconds)).where(Item.job_id == "fenced")).scalar()
    assert ledger_busy == pytest.approx(items_gpu, rel=1e-9)
    # Nothing of the stale attempt is left in the partition's folders: one file each, the committed one.
    record = json.loads((tmp_path / "output" / "_commits" / "job=fenced" / f"partition={victim}.json").read_text())
    for kind in ("outputs", "ledger", "quarantine"):
        folder = tmp_path / "output" / kind / "job=fenced" / f"partition={victim}"
        assert [f"{kind}/job=fenced/partition={victim}/{f}" for f in os.listdir(folder)] == [record["files"][kind]]


def test_record_ids_with_hash_signs_round_trip(make_config, tmp_path):
    (tmp_path / "input").mkdir()
    (tmp_path / "input" / "notes#1.txt").write_text(
        "The quarterly audit found two late invoices and one missing receipt."
    )
    (tmp_path / "input" / "notes#2.txt").write_text("Shipping moved to Tuesdays after the warehouse lease was renewed.")
    job = run_job(make_config(), job_id="hashes")
    con = connect(str(tmp_path / "output"))
    rows = {r[0]: r[1:] for r in con.execute("SELECT id, source, cost_usd, attempts FROM ledger").fetchall()}
    assert set(rows) == {"notes#1.txt", "notes#2.txt"}
    for source, cost, attempts in rows.values():
        assert source == "generated" and cost > 0 and attempts >= 1  # not taken for a duplicate, not free
    assert job.manifest["counts"]["by_source"] == {"generated": 2}


def test_a_commit_record_lost_after_the_catalog_commit_is_published_by_the_job(make_config, sample_corpus, tmp_path):
    """Died between the catalog's commit and the commit record: the partition stays committed, and the
    job's manifest write publishes the record, so readers see every partition."""
    from pipeline.job import faults

    victim = {}

    def lose_record(point, job_id, partition):
        if point == "before_publish" and not victim:
            victim["p"] = partition
            raise OSError("worker lost before its commit record")

    with faults.inject(lose_record):
        job = run_job(make_config(), job_id="republished")
    assert job.manifest["status"] == "succeeded" and victim
    assert (tmp_path / "output" / "_commits" / "job=republished" / f"partition={victim['p']}.json").exists()
    con = connect(str(tmp_path / "output"))
    outputs = con.execute("SELECT count(*) FROM outputs").fetchone()[0]
    quarantined = con.execute("SELECT count(*) FROM quarantine").fetchone()[0]
    assert outputs + quarantined == sample_corpus[1]["documents"] + sample_corpus[1]["bad_records"]


def test_leftovers_of_killed_writes_are_never_read_and_a_rerun_sweeps_them(make_config, sample_corpus, tmp_path):
    """Reproducers (red-team round): a kill while a commit record or a part file was written left a
    `.tmp-<uuid>-<name>` file that ended in `.json` / `.parquet`; a killed `rerun --partition` left the
    older commit's files. The ledger readers counted the partition twice (a partial temp record made them
    raise), DuckDB's glob of the folders read 48 rows for 40, and later reruns never cleaned up."""
    import duckdb

    config = make_config()
    first = run_job(config, job_id="leftover")
    out = tmp_path / "output"
    records = sorted((out / "_commits" / "job=leftover").glob("partition=*.json"))
    record = json.loads(records[0].read_text())
    ledger_file = out / record["files"]["ledger"]
    older = "000000-0123456789ab"  # a commit of an earlier claim (epochs grow with each claim)
    # What the kills left, as the versions before this fix named them, and a partial record as this one does.
    (records[0].parent / f".tmp-{'a' * 32}-{records[0].name}").write_text(records[0].read_text())
    (records[0].parent / f".tmp-{'b' * 32}-{records[0].name}").write_text('{"job_id": "leftover", "fil')
    (records[0].parent / f".{records[0].name}.tmp-{'c' * 32}").write_text('{"job_id": "leftover", "fil')
    an_hour_ago = time.time() - 3600  # temporary records younger than 10 minutes may be a publish in flight
    for leftover in records[0].parent.glob(".*"):
        os.utime(leftover, (an_hour_ago, an_hour_ago))
    (ledger_file.parent / f".tmp-{'d' * 32}-part-{older}.parquet").write_bytes(ledger_file.read_bytes())
    (ledger_file.parent / f"part-{older}.parquet").write_bytes(ledger_file.read_bytes())  # superseded commit

    con = connect(str(out))  # readers that honour commits: each partition once, no error
    assert (
        con.execute("SELECT count(*) FROM ledger WHERE kind = 'output'").fetchone()[0]
        == first.manifest["counts"]["outputs"]
    )

    again = run_job(config, job_id="leftover")  # nothing to do, but the rerun sweeps what kills left
    assert again.manifest["cost"]["cost_usd"] == first.manifest["cost"]["cost_usd"]
    left = sorted(p.name for p in out.rglob("*") if p.is_file() and (".tmp-" in p.name or older in p.name))
    assert left == []
    glob = duckdb.sql(f"SELECT count(*) FROM read_parquet('{out}/ledger/**/*.parquet')").fetchall()[0][0]
    assert glob == read_kind(out, "ledger", "leftover").num_rows
