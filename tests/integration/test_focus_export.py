"""`tokenmill ledger export --format focus` on a real job (fake engine): both bases add up to its ledger."""

import csv
from decimal import Decimal

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from pipeline import run_job
from pipeline.cli import app
from pipeline.output.ledger import connect, summary
from tests.conftest import read_kind


def export(output, to, *args) -> str:
    result = CliRunner().invoke(app, ["ledger", "export", "--output", str(output), "--to", str(to), *args])
    assert result.exit_code == 0, result.output
    return result.stdout


def csv_rows(path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_both_bases_of_a_real_job_add_up_to_its_ledger(make_config, sample_corpus, tmp_path):
    run_job(make_config(), job_id="finops")
    output = tmp_path / "output"
    ledger = read_kind(output, "ledger", "finops")
    assert pc.sum(pc.not_equal(ledger["source"], "generated")).as_py() > 0  # reused rows are in the test

    said = export(output, tmp_path / "alloc.parquet", "--format", "focus", "--job-id", "finops")
    allocation = pq.read_table(tmp_path / "alloc.parquet")
    export(output, tmp_path / "usage.csv", "--format", "focus", "--basis", "usage", "--job-id", "finops")
    usage = csv_rows(tmp_path / "usage.csv")
    assert allocation.num_rows == len(usage) == ledger.num_rows

    # Allocation: exactly the ledger's cost_usd, each rounded once to 18 places (pyarrow's exact cast).
    alloc_total = sum(allocation["BilledCost"].to_pylist(), Decimal(0))
    assert alloc_total == sum(pc.cast(ledger["cost_usd"], pa.decimal128(38, 18)).to_pylist(), Decimal(0))
    assert f"BilledCost {alloc_total} USD" in said
    # ... and what `tokenmill ledger summary` prints (DuckDB's cast rounds through a double: far below a cent).
    ledger_summary = summary(connect(str(output)), [], job_id="finops").to_pylist()[0]["cost_usd"]
    assert float(alloc_total) == pytest.approx(float(ledger_summary), rel=1e-9)

    # Usage: the busy share; allocation − usage: the start-up and idle share.
    usage_total = sum((Decimal(r["BilledCost"]) for r in usage), Decimal(0))
    rows = ledger.to_pylist()
    busy_usd = sum(r["busy_gpu_seconds"] * r["price_per_gpu_hour"] / 3600 for r in rows)
    overhead_usd = sum(r["overhead_gpu_seconds"] * r["price_per_gpu_hour"] / 3600 for r in rows)
    assert float(usage_total) == pytest.approx(busy_usd, rel=1e-9)
    assert overhead_usd > 0 and float(alloc_total - usage_total) == pytest.approx(overhead_usd, rel=1e-9)
    assert alloc_total - usage_total == sum((Decimal(r["x_OverheadCost"]) for r in usage), Decimal(0))
    assert {r["ConsumedUnit"] for r in usage} == {"GPU-Hours"} and {r["x_Basis"] for r in usage} == {"usage"}

    # One tenant: its rows only, and their cost.
    tenant = next(t for t in ledger["tenant"].to_pylist() if t)
    export(output, tmp_path / "one.csv", "--format", "focus", "--tenant", tenant)
    mine = ledger.filter(pc.equal(ledger["tenant"], tenant))
    one = csv_rows(tmp_path / "one.csv")
    assert {r["SubAccountId"] for r in one} == {tenant} and len(one) == mine.num_rows
    assert sum(Decimal(r["BilledCost"]) for r in one) == sum(
        pc.cast(mine["cost_usd"], pa.decimal128(38, 18)).to_pylist(), Decimal(0)
    )


def test_a_file_it_cannot_write_is_refused_in_one_line(tmp_path):
    refused = CliRunner().invoke(
        app, ["ledger", "export", "--output", str(tmp_path), "--to", str(tmp_path / "focus.json")]
    )
    assert (
        refused.exit_code == 2 and refused.stderr.strip() == "error: --to must end in .parquet or .csv, not focus.json"
    )
    basis = CliRunner().invoke(
        app, ["ledger", "export", "--output", str(tmp_path), "--to", str(tmp_path / "f.csv"), "--basis", "amortized"]
    )
    assert basis.exit_code == 2 and "--basis must be allocation or usage" in basis.stderr
