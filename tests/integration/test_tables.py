"""The output's Delta tables over time: `tables migrate` of a root the layout before them wrote, and `tables
maintain` after forced reruns (pipeline/output/tables.py, migrate.py).

tests/data/output-before-tables was written by that layout's own code (output/commit.py before the tables):
jobs nightly-a (p0; p1 committed twice, the second a forced rerun with one more row, and a superseded file a
kill left beside it) and nightly-b (p0), and a job `legacy` of the versions before commit records (part-0
files, no record). Its ledger predates the `acceptable` and `off_topic` columns."""

import os
import shutil

import pyarrow as pa
import pytest
from typer.testing import CliRunner

from pipeline import JobError, run_job
from pipeline.cli import app
from pipeline.job import orchestrate
from pipeline.output import migrate as migration
from pipeline.output.ledger import connect
from pipeline.output.tables import KINDS, SCHEMAS, commit_rows, maintain, old_layout, open_table
from pipeline.stores import storage
from tests.conftest import REPO

FIXTURE = REPO / "tests" / "data" / "output-before-tables"
WANT = {
    "ledger": {("nightly-a", "p0"): 3, ("nightly-a", "p1"): 3, ("nightly-b", "p0"): 2, ("legacy", "p0"): 1},
    "quarantine": {("nightly-a", "p0"): 1, ("nightly-b", "p0"): 2},
}


def counts(out, storage_config=None) -> dict[str, dict]:
    con = connect(str(out), storage_config)
    return {
        kind: {
            (job, p): n
            for job, p, n in con.execute(f"SELECT job_id, partition, count(*) FROM {kind} GROUP BY ALL").fetchall()
        }
        for kind in ("ledger", "quarantine")
    }


def test_a_job_refuses_the_old_layout_and_migrate_converts_it_once(make_config, sample_corpus, tmp_path):
    out = tmp_path / "output"
    shutil.copytree(FIXTURE, out)
    with pytest.raises(JobError, match=f"tokenmill tables migrate --output {out}"):
        run_job(make_config(), job_id="refused")
    with pytest.raises(JobError, match="tokenmill tables migrate"):  # the DAG's first task refuses it too
        orchestrate.keyed_shards(make_config(), "refused-on-airflow")

    done = CliRunner().invoke(app, ["tables", "migrate", "--output", str(out)])
    assert done.exit_code == 0, done.output
    assert "converted 4 partitions" in done.output
    assert counts(out) == WANT  # p1 as its second commit names it; the superseded file never read
    root = storage.resolve(str(out))
    assert not old_layout(root) and not (out / "_commits").exists()
    assert open_table(root, "ledger").transaction_version("nightly-a/p1") == 2
    ledger = connect(str(out)).execute("SELECT count(acceptable), count(*) FROM ledger").fetchone()
    assert ledger == (0, 9)  # the columns it predates read as null

    again = CliRunner().invoke(app, ["tables", "migrate", "--output", str(out)])
    assert again.exit_code == 0 and "converted 0 partitions" in again.output
    assert counts(out) == WANT
    assert (
        run_job(make_config(), job_id="after").manifest.as_json()["status"] == "succeeded"
    )  # the root is a job's again


def test_a_migration_killed_before_its_clean_up_is_run_again(tmp_path, monkeypatch):
    out = tmp_path / "output"
    shutil.copytree(FIXTURE, out)
    root = storage.resolve(str(out))

    def killed(root, path):
        raise KeyboardInterrupt("killed while deleting the old layout")

    monkeypatch.setattr(migration, "delete_tree", killed)
    with pytest.raises(KeyboardInterrupt):
        migration.migrate(root)
    assert old_layout(root)  # still refused by jobs
    monkeypatch.undo()
    assert migration.migrate(root)["skipped"] == 4  # every partition converted before: none twice
    assert counts(out) == WANT and not old_layout(root)


def rows(partition: str, ids: list[str]) -> dict[str, pa.Table]:
    ledger = [{"job_id": "j", "partition": partition, "id": i, "tenant": "t", "cost_usd": 1.0} for i in ids]
    return {
        "outputs": pa.Table.from_pylist(ledger, schema=SCHEMAS["outputs"]),
        "ledger": pa.Table.from_pylist(ledger, schema=SCHEMAS["ledger"]),
        "quarantine": SCHEMAS["quarantine"].empty_table(),
    }


def test_a_forced_rerun_replaces_the_partition_in_one_version_and_maintain_deletes_the_old_files(tmp_path):
    out = tmp_path / "out"
    root = storage.resolve(str(out))
    for p in ("p0", "p1", "p2"):
        assert commit_rows(root, "j", p, rows(p, [f"{p}-a", f"{p}-b"]))
    before = {kind: open_table(root, kind).version() for kind in KINDS}
    first_files = set(open_table(root, "ledger").file_uris())

    assert commit_rows(root, "j", "p1", rows("p1", ["p1-a", "p1-b"]), epoch=2)  # the forced rerun: same rows
    assert {kind: open_table(root, kind).version() for kind in KINDS} == {k: v + 1 for k, v in before.items()}
    ledger = connect(str(out)).execute("SELECT partition, count(*) FROM ledger GROUP BY 1 ORDER BY 1").fetchall()
    assert ledger == [("p0", 2), ("p1", 2), ("p2", 2)]
    replaced = first_files - set(open_table(root, "ledger").file_uris())
    assert len(replaced) == 1 and all(os.path.exists(f) for f in replaced)  # time travel still reads it

    done = maintain(root, retention_hours=0, target_mb=128)
    assert done["ledger"]["files_deleted"] >= 1 and done["ledger"]["files"] == 3  # one file per partition
    assert not any(os.path.exists(f) for f in replaced)
    assert connect(str(out)).execute("SELECT count(*) FROM ledger").fetchone()[0] == 6


def test_a_new_ledger_column_arrives_as_schema_evolution(tmp_path):
    """A ledger table made before a column existed takes it as a change of the table's schema at the next
    commit; the rows committed before read it as null."""
    from deltalake import DeltaTable, write_deltalake

    out = tmp_path / "out"
    root = storage.resolve(str(out))
    older = pa.schema([f for f in SCHEMAS["ledger"] if f.name != "acceptable"])
    DeltaTable.create(str(out / "ledger"), older, partition_by=["job_id", "partition"])
    old_rows = pa.Table.from_pylist([{"job_id": "j", "partition": "p0", "id": "a", "cost_usd": 1.0}], schema=older)
    write_deltalake(str(out / "ledger"), old_rows, mode="append")
    new = rows("p1", ["b"])
    new["ledger"] = new["ledger"].set_column(
        new["ledger"].schema.get_field_index("acceptable"), "acceptable", pa.array([True])
    )
    assert commit_rows(root, "j", "p1", new)
    assert "acceptable" in open_table(root, "ledger").schema().to_arrow().names
    got = connect(str(out)).execute("SELECT id, acceptable FROM ledger ORDER BY id").fetchall()
    assert got == [("a", None), ("b", True)]
