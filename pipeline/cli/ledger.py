"""Ledgers: cost summaries and SQL over an output root's ledger, outputs and quarantine, and the HTML report."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from pipeline.cli.common import app, console, fail, ledger_app, load

OutputOption = typer.Option(
    ..., "--output", help="Output root holding ledger/, outputs/, quarantine/ (local or s3://)."
)
LedgerConfigOption = typer.Option(None, "--config", "-c", help="Config for storage settings (S3 endpoint, region).")
FormatOption = typer.Option("table", "--format", help="table, csv or json")
# The ledger's row filters, shared by the commands that read it (output.ledger.ledger_where).
JobIdOption = typer.Option(None, "--job-id", help="Only this job.")
SinceOption = typer.Option(None, "--since", formats=["%Y-%m-%d"], help="From this day (UTC), inclusive.")
UntilOption = typer.Option(None, "--until", formats=["%Y-%m-%d"], help="To this day (UTC), inclusive.")
AsOfOption = typer.Option(
    None,
    "--as-of",
    help="Read the tables as they were: a table version (e.g. 12) or a time (2026-12-07T06:00, UTC unless it says).",
)


def _plain(v):
    from decimal import Decimal

    return float(v) if isinstance(v, Decimal) else v.isoformat() if hasattr(v, "isoformat") else v


def print_table(table, format: str, title: str | None = None) -> None:
    """An Arrow table as a rich table, CSV or JSON on stdout."""
    from decimal import Decimal

    if format == "csv":
        import io

        from pipeline.output.safe_text import write_safe_csv

        buf = io.BytesIO()
        write_safe_csv(table, buf)
        text = buf.getvalue().decode()
        typer.echo(text if text.endswith("\n") else text + "\n", nl=False)
        return
    if format == "json":
        typer.echo(json.dumps([{k: _plain(v) for k, v in r.items()} for r in table.to_pylist()], indent=2))
        return
    if format != "table":
        fail(f"--format must be table, csv or json, not {format}")
    from rich.measure import Measurement

    def cell(v) -> str:
        return "-" if v is None else f"{v:.6f}" if isinstance(v, (float, Decimal)) else str(v)

    rows = list(zip(*(column.to_pylist() for column in table.columns)))
    out = Table(title=title)
    for field in table.schema:  # by position: a result may repeat a column name
        out.add_column(field.name, justify="left" if field.type in ("string",) else "right")
    for r in rows:
        out.add_row(*map(cell, r))
    if Measurement.get(console, console.options.update(max_width=10_000), out).maximum <= console.width:
        console.print(out)
        return
    # Too wide for the terminal (or a log's 100 columns): one block per row, a column per line, as psql's \x does,
    # rather than cells squeezed to a few letters each.
    for i, r in enumerate(rows, 1):
        block = Table(title=f"{title or 'result'}: row {i} of {len(rows)}", show_header=False)
        block.add_column(justify="left")
        block.add_column(justify="right")
        for field, v in zip(table.schema, r):
            block.add_row(field.name, cell(v))
        console.print(block)


def _storage_config(config: Optional[Path]):
    from pipeline.config import StorageConfig

    return load(config).storage if config else StorageConfig()


def as_of_value(text: str | None) -> int | datetime | None:
    """`--as-of`: a table version (a whole number) or a time (ISO 8601; UTC when it names no zone)."""
    from datetime import timezone

    if text is None:
        return None
    if text.isdigit():
        return int(text)
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        fail(f"--as-of must be a table version or a time such as 2026-12-07T06:00, not {text}")
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


def _connect(output: str, config: Optional[Path], as_of: str | None = None):
    from pipeline.output.ledger import connect
    from pipeline.stores.storage import StorageError

    storage_config = _storage_config(config)
    moment = as_of_value(as_of)
    try:
        return connect(output, storage_config, moment)
    except StorageError as e:
        fail(str(e))
    except Exception as e:  # delta-rs: no version of the tables that old, or a version that does not exist
        if moment is None:
            raise
        fail(f"--as-of {as_of}: {str(e).splitlines()[0]}")


@ledger_app.command("summary")
def ledger_summary(
    output: str = OutputOption,
    by: str = typer.Option(
        "tenant,tier",
        "--by",
        help="Comma-separated: tenant, tier, model, adapter, source, job, partition, day (or '' for one total row).",
    ),
    job_id: Optional[str] = JobIdOption,
    since: Optional[datetime] = SinceOption,
    until: Optional[datetime] = UntilOption,
    format: str = FormatOption,
    config: Optional[Path] = LedgerConfigOption,
    as_of: Optional[str] = AsOfOption,
) -> None:
    """Items, tokens, GPU-seconds, cost, baseline and saving, grouped as asked."""
    from pipeline.output.ledger import LedgerError, summary

    keys = [b.strip() for b in by.split(",") if b.strip()]
    try:
        table = summary(
            _connect(output, config, as_of),
            keys,
            job_id,
            since.date() if since else None,
            until.date() if until else None,
        )
    except LedgerError as e:
        fail(str(e))
    print_table(table, format, title="ledger summary")


@ledger_app.command("sql")
def ledger_sql(
    sql: str = typer.Argument(..., help="A query over the views ledger, outputs and quarantine."),
    output: str = OutputOption,
    format: str = FormatOption,
    config: Optional[Path] = LedgerConfigOption,
    as_of: Optional[str] = AsOfOption,
) -> None:
    """Run SQL (DuckDB) over the ledger, outputs and quarantine of an output root."""
    from pipeline.output.ledger import LedgerError, query

    try:
        table = query(_connect(output, config, as_of), sql)
    except LedgerError as e:
        fail(str(e))
    print_table(table, format)


@ledger_app.command("export")
def ledger_export(
    output: str = OutputOption,
    to: Path = typer.Option(..., "--to", help="File to write: .parquet or .csv (chosen by the extension)."),
    format: str = typer.Option("focus", "--format", help="focus: FinOps FOCUS 1.2 cost and usage rows."),
    basis: str = typer.Option(
        "allocation",
        "--basis",
        help="allocation (busy + start-up and idle shares: reconciles to the ledger's cost_usd) or usage (busy only).",
    ),
    job_id: Optional[str] = JobIdOption,
    tenant: Optional[str] = typer.Option(
        None, "--tenant", help="Only this tenant (lost work, having none, is left out)."
    ),
    since: Optional[datetime] = SinceOption,
    until: Optional[datetime] = UntilOption,
    account: str = typer.Option("tokenmill", "--billing-account", help="BillingAccountId and BillingAccountName."),
    config: Optional[Path] = LedgerConfigOption,
    as_of: Optional[str] = AsOfOption,
) -> None:
    """Write the ledger's rows as a FOCUS 1.2 file for FinOps tools (docs/analyst.md#focus-export)."""
    import pyarrow.compute as pc

    from pipeline.output.focus import BASES, FocusError, read_ledger, to_focus

    if format != "focus":
        fail(f"--format must be focus, not {format}")
    if basis not in BASES:
        fail(f"--basis must be {' or '.join(BASES)}, not {basis}")
    suffix = to.suffix.lower()
    if suffix not in (".parquet", ".csv"):
        fail(f"--to must end in .parquet or .csv, not {to.name}")
    try:
        ledger = read_ledger(
            _connect(output, config, as_of),
            job_id,
            tenant,
            since.date() if since else None,
            until.date() if until else None,
        )
        focus = to_focus(ledger, basis, account)
    except FocusError as e:
        fail(str(e))
    _write_export(focus, to, suffix)
    total = pc.sum(focus["BilledCost"]).as_py() or 0
    typer.echo(f"wrote {focus.num_rows} FOCUS rows ({basis} basis, BilledCost {total} USD) to {to}")


def _write_export(table, to: Path, suffix: str) -> None:
    """Parquet or CSV, written beside `to` and renamed over it: a reader never sees half a file."""
    import pyarrow.parquet as pq

    from pipeline.output.focus import csv_ready
    from pipeline.output.safe_text import write_safe_csv

    to.parent.mkdir(parents=True, exist_ok=True)
    partial = to.with_name(f".{to.name}.partial")
    if suffix == ".csv":
        write_safe_csv(csv_ready(table), partial)
    else:
        pq.write_table(table, partial, compression="zstd")
    partial.replace(to)


def _eval_result(path: Optional[Path]):
    """--eval PATH, else the latest `tokenmill eval` result under $TOKENMILL_HOME when there is one."""
    from pipeline.config import tokenmill_home
    from pipeline.output.report import load_eval

    if path is None:
        path = tokenmill_home() / "eval" / "eval.json"
        if not path.is_file():
            return None
    try:
        return load_eval(path)
    except ValueError as e:
        fail(str(e))


@app.command("report")
def report(
    output: str = OutputOption,
    job_id: str = typer.Option(..., "--job-id"),
    out: Path = typer.Option(..., "--out", help="HTML file to write (self-contained: opens offline)."),
    eval_path: Optional[Path] = typer.Option(
        None,
        "--eval",
        help=(
            "A `tokenmill eval` eval.json for the quality section (default $TOKENMILL_HOME/eval/eval.json "
            "when it exists)."
        ),
    ),
    config: Optional[Path] = LedgerConfigOption,
) -> None:
    """Write a job's report: cost by tenant and tier, savings waterfall, throughput, reuse, slowest partitions,
    quality."""
    from pipeline.output.report import build_report
    from pipeline.stores.storage import StorageError

    eval_result = _eval_result(eval_path)
    try:
        page = build_report(output, job_id, _storage_config(config), eval_result)
    except StorageError as e:
        fail(str(e))
    out.write_text(page, encoding="utf-8")
    typer.echo(f"wrote {out}")
