"""Every CSV tokenmill writes opens in a spreadsheet as text (no client-chosen cell runs as a formula), and every
JSONL line it writes stays one line for any line splitter (pipeline/output/safe_text.py)."""

from __future__ import annotations

import csv
import io
import json
from datetime import datetime, timezone

import pyarrow as pa
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.output.safe_text import FORMULA_START, json_line, safe_cells
from pipeline.output.tables import commit_rows
from pipeline.schema import LEDGER, OUTPUTS, QUARANTINE
from pipeline.stores import storage

HOSTILE = ['=HYPERLINK("http://x","y")', "+1+cmd|' /C calc'!A0", "-2+3", "@SUM(1)", "\tx", "\ry"]


def hostile_ledger(out) -> None:
    """One committed partition whose ids and tenants (chosen by API clients) are formulas."""
    root = storage.resolve(str(out))
    rows = [
        {
            "job_id": "csv",
            "partition": "p0",
            "id": cell,
            "tenant": cell,
            "tier": "small",
            "model": "m",
            "source": "generated",
            "prompt_tokens": 10,
            "cached_prompt_tokens": 0,
            "output_tokens": 5,
            "gpu_seconds": 1.0,
            "price_per_gpu_hour": 3.6,
            "cost_usd": 0.001,
            "baseline_cost_usd": 0.001,
            "created_at": datetime(2026, 11, 20, tzinfo=timezone.utc),
            "kind": "output",
            "acceptable": True,
        }
        for cell in HOSTILE
    ]
    tables = {
        "ledger": pa.Table.from_pylist(rows, schema=LEDGER),
        "outputs": pa.Table.from_pylist([], schema=pa.schema([("partition", pa.string()), *OUTPUTS])),
        "quarantine": pa.Table.from_pylist([], schema=pa.schema([("partition", pa.string()), *QUARANTINE])),
    }
    commit_rows(root, "csv", "p0", tables)


def executable(rows: list[dict]) -> list[str]:
    """Cells a spreadsheet would run: text starting with a formula character (a number is only a number)."""

    def number(cell: str) -> bool:
        try:
            float(cell)
            return True
        except ValueError:
            return False

    return [c for r in rows for c in r.values() if c and c.startswith(FORMULA_START) and not number(c)]


def test_every_csv_tokenmill_writes_holds_no_formula(tmp_path):
    hostile_ledger(tmp_path / "out")
    cli = CliRunner()
    summary = cli.invoke(
        app, ["ledger", "summary", "--output", str(tmp_path / "out"), "--by", "tenant", "--format", "csv"]
    )
    assert summary.exit_code == 0, summary.output
    rows = list(csv.DictReader(io.StringIO(summary.stdout)))
    assert len(rows) == len(HOSTILE) and executable(rows) == []
    assert {r["tenant"] for r in rows} == {"'" + cell for cell in HOSTILE}  # shown as text, nothing lost

    to = tmp_path / "focus.csv"
    export = cli.invoke(app, ["ledger", "export", "--output", str(tmp_path / "out"), "--to", str(to)])
    assert export.exit_code == 0, export.output
    with open(to, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(HOSTILE) and executable(rows) == []
    assert {r["x_ItemId"] for r in rows} == {r["SubAccountId"] for r in rows} == {"'" + c for c in HOSTILE}


def test_safe_cells_leaves_numbers_and_plain_text_alone():
    table = pa.table({"n": [-1.5, 2.0], "t": ["plain", None], "f": ["=1", "a=1"]})
    assert safe_cells(table).to_pylist() == [{"n": -1.5, "t": "plain", "f": "'=1"}, {"n": 2.0, "t": None, "f": "a=1"}]


def test_a_jsonl_line_is_one_line_for_every_splitter():
    value = {"custom_id": "a\u2028b", "text": "c\u2029d\u0085e\u00e9"}
    line = json_line(value)
    assert line.splitlines() == [line[:-1]] and json.loads(line) == value
    assert "\u00e9" in line  # other characters stay as they are (ensure_ascii=False)
