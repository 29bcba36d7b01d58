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
from pipeline.output.tables import open_table, published_epochs
from pipeline.stores import storage
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
    with state.db_session() as s:
        from sqlalchemy import func, select

        from pipeline.stores.catalog import Item

        items_gpu = s.execute(select(func.sum(Item.gpu_seconds)).where(Item.job_id == "fenced")).scalar()
    assert ledger_busy == pytest.approx(items_gpu, rel=1e-9)
    # Each table holds the partition as the second claim committed it, once: one file, the one its log names.
    root = storage.resolve(str(tmp_path / "output"))
    for kind in ("outputs", "ledger", "quarantine"):
        table = open_table(root, kind)
        assert table.transaction_version(f"fenced/{victim}") == 2
        named = [p for p in table.file_uris() if f"partition={victim}/" in p]
        folder = tmp_path / "output" / kind / "job_id=fenced" / f"partition={victim}"
        assert len(named) == 1 and [str(f) for f in folder.iterdir()] == named


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
    assert job.manifest.as_json()["counts"]["by_source"] == {"generated": 2}


def test_a_publish_lost_after_the_catalog_commit_is_done_by_the_job(make_config, sample_corpus, tmp_path):
    """Died between the catalog's commit and the tables' transactions: the partition stays committed, and the
    job's manifest write publishes its staged files, so readers see every partition."""
    from pipeline.job import faults

    victim = {}

    def lose_record(point, job_id, partition):
        if point == "before_publish" and not victim:
            victim["p"] = partition
            raise OSError("worker lost before its tables' transactions")

    config = make_config()
    with faults.inject(lose_record):
        job = run_job(config, job_id="republished")
    assert job.manifest.as_json()["status"] == "succeeded" and victim
    epoch = [p.epoch for p in StateStore(config.state.url).partitions("republished") if p.partition == victim["p"]]
    root = storage.resolve(str(tmp_path / "output"))
    assert published_epochs(root, "republished", [victim["p"]]) == {victim["p"]: epoch[0]}
    con = connect(str(tmp_path / "output"))
    outputs = con.execute("SELECT count(*) FROM outputs").fetchone()[0]
    quarantined = con.execute("SELECT count(*) FROM quarantine").fetchone()[0]
    assert outputs + quarantined == sample_corpus[1]["documents"] + sample_corpus[1]["bad_records"]


def test_files_no_table_log_names_are_never_read(make_config, sample_corpus, tmp_path):
    """A kill between staging a partition's files and the catalog's commit leaves Parquet files in the tables'
    folders that no Delta log names: no reader of the tables counts them (a plain glob of the folders would,
    which is why docs/analyst.md reads the tables and never globs)."""
    config = make_config()
    first = run_job(config, job_id="leftover")
    out = tmp_path / "output"
    (folder,) = [f for f in (out / "ledger" / "job_id=leftover").iterdir()][:1]
    (committed,) = list(folder.iterdir())
    (folder / "part-00000000-0123456789ab.parquet").write_bytes(committed.read_bytes())  # a killed claim's
    con = connect(str(out))
    assert (
        con.execute("SELECT count(*) FROM ledger WHERE kind = 'output'").fetchone()[0]
        == first.manifest.as_json()["counts"]["outputs"]
    )
    again = run_job(config, job_id="leftover")  # nothing to do: nothing published twice
    assert again.manifest.as_json()["cost"]["cost_usd"] == first.manifest.as_json()["cost"]["cost_usd"]
    assert read_kind(out, "ledger", "leftover").num_rows == con.execute("SELECT count(*) FROM ledger").fetchone()[0]


PLAIN_READERS = """
import json, sys
import duckdb, duckdb_extension_delta, polars as pl
from pathlib import Path

out, extensions = sys.argv[1], sys.argv[2]
wheel = Path(duckdb_extension_delta.__file__).parent / "extensions" / f"v{duckdb.__version__}"
con = duckdb.connect(config={"extension_directory": extensions})
con.execute("SET enable_progress_bar = false")
con.install_extension(str(wheel / "delta.duckdb_extension"))
con.load_extension("delta")
seen = {"duckdb": {}, "polars": {}}
for kind in ("outputs", "quarantine", "ledger"):
    if not (Path(out) / kind / "_delta_log").exists():
        continue
    rows = con.sql(f"SELECT partition, count(*) FROM delta_scan('{out}/{kind}') GROUP BY ALL").fetchall()
    seen["duckdb"][kind] = dict(rows)
    frame = pl.read_delta(f"{out}/{kind}").group_by("partition").len()
    seen["polars"][kind] = dict(zip(frame["partition"].to_list(), frame["len"].to_list()))
print(json.dumps(seen))
"""


def test_plain_duckdb_and_polars_read_whole_partitions_mid_job(make_config, sample_corpus, tmp_path):
    """Mid-job, at every partition's commit point (committed in the catalog, not yet in the tables), plain
    DuckDB (delta_scan, the extension from its wheel) and Polars in another process read each table: every
    partition they see is one the catalog committed, with its rows whole, and every partition the catalog
    committed before it is there."""
    from pipeline.job import faults

    config = make_config(input__records_per_partition=8)
    state = StateStore(config.state.url)
    checks = []

    def read_mid_job(point, job_id, partition):
        if point != "before_publish":
            return
        done = subprocess.run(
            [sys.executable, "-c", PLAIN_READERS, str(tmp_path / "output"), str(tmp_path / "duckdb-extensions")],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        committed = {
            p.partition: json.loads(p.counts)
            for p in state.partitions(job_id)
            if p.status == "succeeded" and p.partition != partition
        }
        for engine, tables in json.loads(done.stdout).items():
            assert set(tables.get("outputs", {})) == {p for p, c in committed.items() if c["outputs"]}, engine
            for p, counts in committed.items():
                assert tables.get("outputs", {}).get(p, 0) == counts["outputs"], (engine, p)
                assert tables.get("quarantine", {}).get(p, 0) == counts["quarantined"], (engine, p)
            assert set(tables.get("ledger", {})) <= set(committed), engine
        checks.append(len(committed))

    with faults.inject(read_mid_job):
        job = run_job(config, job_id="midjob")
    assert job.manifest.as_json()["status"] == "succeeded"
    assert checks == list(range(len(job.manifest.as_json()["partitions"])))  # read at every commit point, 0 to n-1 done
