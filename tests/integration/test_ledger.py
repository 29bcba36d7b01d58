"""Ledger questions: DuckDB answers must equal pyarrow sums over the same files, to the cent and below."""

import csv
import io
import json
import random
import subprocess
import sys
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal

import pyarrow as pa
import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.output.ledger import LedgerError, connect, query, summary
from pipeline.output.tables import commit_rows, open_table, read
from pipeline.schema import LEDGER, OUTPUTS, QUARANTINE
from pipeline.stores import storage
from tests.conftest import REPO


def fake_job(root: storage.Location, job_id: str, day: datetime, rows: int, seed: int) -> None:
    rng = random.Random(seed)
    for p in range(3):
        part = f"p{p}"
        ledger = []
        for i in range(rows):
            gpu = rng.random() * 3
            price = rng.choice([3.5, 7.0])
            ledger.append(
                {
                    "job_id": job_id,
                    "partition": part,
                    "id": f"{job_id}-{p}-{i}",
                    "tenant": rng.choice(["acme", "globex"]),
                    "tier": "small" if price == 3.5 else "large",
                    "model": "m",
                    "source": rng.choice(["generated", "duplicate_in_job"]),
                    "prompt_tokens": rng.randint(10, 900),
                    "cached_prompt_tokens": 0,
                    "output_tokens": rng.randint(1, 200),
                    "gpu_seconds": gpu,
                    "price_per_gpu_hour": price,
                    "cost_usd": gpu * price / 3600,
                    "baseline_cost_usd": gpu * 7.0 / 3600,
                    "created_at": day,
                    "kind": "output",
                    "acceptable": rng.random() < 0.7,
                }
            )
        outputs = [
            {
                "partition": part,
                **{k: r.get(k) for k in OUTPUTS.names},
                "summary": "s",
                "finish_reason": "length",
                "template_version": "v1",
            }
            for r in ledger
        ]
        commit_rows(
            root,
            job_id,
            part,
            {
                "ledger": pa.Table.from_pylist(ledger, schema=LEDGER),
                "outputs": pa.Table.from_pylist(outputs, schema=pa.schema([("partition", pa.string()), *OUTPUTS])),
                "quarantine": pa.Table.from_pylist(
                    [{"partition": part, "id": f"bad-{p}", "reason": "empty_text", "job_id": job_id}],
                    schema=pa.schema([("partition", pa.string()), *QUARANTINE]),
                ),
            },
        )


@pytest.fixture
def output_root(tmp_path):
    root = storage.resolve(str(tmp_path / "out"))
    t0 = datetime(2026, 11, 20, 2, 0, tzinfo=timezone.utc)
    for n in range(4):
        fake_job(root, f"job-{n}", t0 + timedelta(days=n), rows=250, seed=n)
    return tmp_path / "out"


def pyarrow_totals(output_root, by: str, where=None) -> dict:
    table = read(storage.resolve(str(output_root)), "ledger")
    if where is not None:
        table = table.filter(where(table))
    grouped = table.group_by(by).aggregate([("cost_usd", "sum"), ("baseline_cost_usd", "sum"), ("id", "count")])
    return {r[by]: r for r in grouped.to_pylist()}


def test_summary_by_tenant_equals_pyarrow_to_the_cent(output_root):
    got = {r["tenant"]: r for r in summary(connect(str(output_root)), ["tenant"]).to_pylist()}
    want = pyarrow_totals(output_root, "tenant")
    assert set(got) == set(want) == {"acme", "globex"}
    for tenant, row in got.items():
        assert row["items"] == want[tenant]["id_count"]
        assert isinstance(row["cost_usd"], Decimal)
        assert round(row["cost_usd"], 2) == round(Decimal(want[tenant]["cost_usd_sum"]), 2)
        assert float(row["cost_usd"]) == pytest.approx(want[tenant]["cost_usd_sum"], rel=1e-12)
        assert float(row["saved_usd"]) == pytest.approx(
            want[tenant]["baseline_cost_usd_sum"] - want[tenant]["cost_usd_sum"], rel=1e-9
        )


def test_cost_per_acceptable_document_counts_every_charge_over_the_acceptable_documents(output_root):
    """What a buyer of summaries pays for. Per tier: documents (outputs, not charge rows), the acceptable
    ones (no output check failed), and the group's whole cost over each, lost work included."""
    root = storage.resolve(str(output_root))
    lost = {
        "job_id": "job-0",
        "partition": "lost",
        "tier": "small",
        "model": "m",
        "kind": "lost",
        "cost_usd": 0.01,
        "gpu_seconds": 10.0,
        "created_at": datetime(2026, 11, 20, tzinfo=timezone.utc),
    }
    empty = {
        kind: pa.schema([("partition", pa.string()), *schema]).empty_table()
        for kind, schema in (("outputs", OUTPUTS), ("quarantine", QUARANTINE))
    }
    commit_rows(root, "job-0", "lost", {"ledger": pa.Table.from_pylist([lost], schema=LEDGER), **empty})
    table = read(storage.resolve(str(output_root)), "ledger").to_pylist()
    got = {r["tier"]: r for r in summary(connect(str(output_root)), ["tier"]).to_pylist()}
    for tier, row in got.items():
        rows = [r for r in table if r["tier"] == tier]
        documents = [r for r in rows if r["kind"] == "output"]
        acceptable = [r for r in documents if r["acceptable"]]
        cost = sum(r["cost_usd"] for r in rows)
        assert row["documents"] == len(documents) == row["items"] - (tier == "small") == len(rows) - (tier == "small")
        assert row["acceptable"] == len(acceptable) and 0 < len(acceptable) < len(documents)
        assert row["acceptable_share"] == pytest.approx(len(acceptable) / len(documents))
        assert float(row["cost_per_document_usd"]) == pytest.approx(cost / len(documents), rel=1e-9)
        assert float(row["cost_per_acceptable_usd"]) == pytest.approx(cost / len(acceptable), rel=1e-9)


def test_filters_by_job_and_day(output_root):
    con = connect(str(output_root))
    one = summary(con, ["job"], job_id="job-2").to_pylist()
    assert [r["job"] for r in one] == ["job-2"] and one[0]["items"] == 750
    recent = summary(con, ["day"], since=date(2026, 11, 22)).to_pylist()
    assert [r["day"] for r in recent] == [date(2026, 11, 22), date(2026, 11, 23)]
    window = summary(con, [], since=date(2026, 11, 21), until=date(2026, 11, 22)).to_pylist()
    assert window[0]["items"] == 1500


def test_unknown_group_key_is_refused(output_root):
    with pytest.raises(LedgerError, match="cannot group by colour"):
        summary(connect(str(output_root)), ["colour"])


def test_sql_views_and_read_only(output_root):
    con = connect(str(output_root))
    joined = query(con, "SELECT count(*) AS n FROM outputs o JOIN ledger l USING (job_id, id)").to_pylist()
    assert joined == [{"n": 3000}]
    per_partition = query(con, "SELECT partition, count(*) AS n FROM quarantine GROUP BY 1 ORDER BY 1").to_pylist()
    assert per_partition == [{"partition": f"p{i}", "n": 4} for i in range(3)]
    with pytest.raises(LedgerError, match="queries only"):
        query(con, "DELETE FROM ledger")
    with pytest.raises(LedgerError, match="nope"):
        query(con, "SELECT * FROM nope")


@pytest.mark.parametrize(
    "sql",
    [
        "/* x */ COPY (SELECT 1) TO '{out}/copied.csv'",
        "SELECT 1; COPY (SELECT 1) TO '{out}/copied.csv'",
        "ATTACH '{out}/attached.db' AS a; CREATE TABLE a.t AS SELECT 1",
        "SELECT * FROM read_text('/etc/hostname')",
        "SELECT * FROM glob('/etc/*')",
        "SELECT * FROM read_csv('/etc/passwd')",
        "INSTALL httpfs",
        "SET enable_external_access = true",
        "RESET lock_configuration",
        "SELECT * FROM read_parquet('{out}/../**/*.parquet')",
    ],
)
def test_ledger_sql_reaches_nothing_but_the_views(output_root, tmp_path, sql):
    """Read-only by construction: DuckDB's external access is off and its configuration locked, so no
    statement, however it starts, reads or writes a file, loads an extension or turns that back on."""
    con = connect(str(output_root))
    with pytest.raises(LedgerError):
        query(con, sql.format(out=tmp_path))
    assert not [p.name for p in tmp_path.iterdir() if p.name in ("copied.csv", "attached.db")]
    assert query(con, "SELECT count(*) AS n FROM ledger").to_pylist() == [{"n": 3000}]  # the views still work


def test_empty_output_root_answers_zero(tmp_path):
    rows = summary(connect(str(tmp_path)), []).to_pylist()
    assert rows[0]["items"] == 0


def test_cli_summary_csv_and_json(output_root):
    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "pipeline.cli", "ledger", *args],
            capture_output=True,
            text=True,
            cwd=REPO,
            check=True,
        ).stdout

    rows = list(
        csv.DictReader(io.StringIO(cli("summary", "--output", str(output_root), "--by", "tier", "--format", "csv")))
    )
    want = pyarrow_totals(output_root, "tier")
    assert {r["tier"]: round(Decimal(r["cost_usd"]), 2) for r in rows} == {
        t: round(Decimal(w["cost_usd_sum"]), 2) for t, w in want.items()
    }
    total = json.loads(cli("summary", "--output", str(output_root), "--by", "", "--format", "json"))
    assert total[0]["items"] == 3000
    listed = json.loads(
        cli("sql", "--output", str(output_root), "SELECT DISTINCT job_id FROM ledger ORDER BY 1", "--format", "json")
    )
    assert [r["job_id"] for r in listed] == [f"job-{n}" for n in range(4)]


def test_as_of_reads_the_tables_as_they_were(tmp_path):
    """Time travel: `--as-of` a time or a table version reads the ledger as it was then, whatever committed
    since (a new job, a forced rerun replacing a partition)."""
    out = tmp_path / "out"
    root = storage.resolve(str(out))
    fake_job(root, "early", datetime(2026, 11, 20, tzinfo=timezone.utc), rows=10, seed=1)
    table = open_table(root, "ledger")
    version = table.version()
    # the early job's last commit, as its log entry dates it: a later commit is later (it writes its files first)
    moment = datetime.fromtimestamp(table.history(1)[0]["timestamp"] / 1000, timezone.utc)
    fake_job(root, "late", datetime(2026, 11, 21, tzinfo=timezone.utc), rows=10, seed=2)

    def jobs(as_of: str | None) -> list[str]:
        args = ["--as-of", as_of] if as_of else []
        sql = "SELECT DISTINCT job_id FROM ledger ORDER BY 1"
        result = CliRunner().invoke(app, ["ledger", "sql", "--output", str(out), sql, "--format", "json", *args])
        assert result.exit_code == 0, result.output
        return [r["job_id"] for r in json.loads(result.output)]

    assert jobs(None) == ["early", "late"]
    assert jobs(moment.isoformat()) == ["early"]
    assert jobs(str(version)) == ["early"]
    refused = CliRunner().invoke(app, ["ledger", "summary", "--output", str(out), "--as-of", "999"])
    assert refused.exit_code != 0 and "--as-of 999" in refused.output


def test_ledger_over_s3(s3_server, s3_client, tmp_path):
    from pipeline.config import StorageConfig

    s3_client.create_bucket(Bucket="ledgers")
    config = StorageConfig(s3_endpoint_url=s3_server)
    fake_job(storage.resolve("s3://ledgers/root", config), "s3job", datetime(2026, 11, 29, tzinfo=timezone.utc), 20, 1)
    rows = summary(connect("s3://ledgers/root", config), ["job"]).to_pylist()
    assert rows[0]["job"] == "s3job" and rows[0]["items"] == 60


def test_ledger_days_are_utc_days_whatever_the_machines_time_zone(tmp_path, monkeypatch):
    """Reproducer: under TZ=America/New_York a row created 2026-11-20T02:00Z was on 2026-11-19 for
    `--since`/`--until` and `by day`, while the FOCUS billing periods and the docs say UTC days."""
    import time

    from pipeline.output.ledger import connect

    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        con = connect(str(tmp_path / "empty-output"))
        day = con.sql("SELECT CAST(TIMESTAMPTZ '2026-11-20 02:00:00+00' AS DATE)").fetchall()[0][0]
        assert str(day) == "2026-11-20"
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()
