"""What every command module shares: the typer app and its groups, the console, common options,
and the helpers that turn a bad config or an unreachable store into one `error:` line."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer
from rich.console import Console

from pipeline import ConfigError, load_config

# vLLM logs every engine step at INFO; a batch job's own progress lines are what people read.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="tokenmill: batch LLM summarisation at the lowest cost per document.",
)
jobs_app = typer.Typer(no_args_is_help=True, help="Jobs in the state catalog.")
ledger_app = typer.Typer(no_args_is_help=True, help="Query the cost ledgers (DuckDB over the Parquet files).")
router_app = typer.Typer(no_args_is_help=True, help="Train and calibrate the learned router on your own labels.")
models_app = typer.Typer(no_args_is_help=True, help="Build local models.")
config_app = typer.Typer(no_args_is_help=True, help="Inspect configuration.")
cache_app = typer.Typer(no_args_is_help=True, help="The reuse cache across jobs.")
checks_app = typer.Typer(no_args_is_help=True, help="The output checks on your own outputs and labels.")
app.add_typer(jobs_app, name="jobs")
app.add_typer(ledger_app, name="ledger")
app.add_typer(router_app, name="router")
app.add_typer(models_app, name="models")
app.add_typer(config_app, name="config")
app.add_typer(cache_app, name="cache")
app.add_typer(checks_app, name="checks")

# Off a terminal (pipes, Airflow logs, CI) 100 columns, which a log viewer shows without scrolling: tables wrap
# their cells to fit, and a result too wide even so is printed a row at a time (print_table).
# No markup, emoji codes or highlighting: ids, tenants and file names are data, and `[/x]` in one crashed the
# command after its job had committed. Styling is given as rich Text objects, never parsed from strings.
console = Console(width=None if sys.stdout.isatty() else 100, markup=False, emoji=False, highlight=False)
ConfigOption = typer.Option(..., "--config", "-c", help="YAML config file (e.g. configs/local.yaml).")


def fail(message: str, code: int = 2) -> None:
    """Print `error: <message>` as one line on stderr and exit with `code`."""
    typer.echo(f"error: {' '.join(message.split())}", err=True)  # always one line
    raise typer.Exit(code)


def load(path: Path, **overrides):
    """The config at `path` with `overrides`, or exit with the config error."""
    try:
        return load_config(path, **overrides)
    except ConfigError as e:
        fail(str(e))


def state_store(cfg):
    """The job-state catalog of `cfg`, or exit when it cannot be opened. Opening it changes nothing: a command
    that only reads never migrates (`migrate_catalog` is a writing command's first step)."""
    from pipeline.stores.catalog import StateError, StateStore

    try:
        state = StateStore(cfg.state.url)
    except StateError as e:
        fail(str(e))
    if not state.has_schema():
        fail(f"the state catalog {state.safe_url(cfg.state.url)} has no tables yet: run `tokenmill migrate` (or a job)")
    return state


def migrate_catalog(cfg) -> None:
    """Bring the catalog of `cfg` to the latest schema (once per process), or exit saying why it cannot."""
    from pipeline.stores.catalog import StateError, migrate

    try:
        migrate(cfg.state.url, once=True)
    except StateError as e:
        fail(str(e))


def when(value) -> str:
    """A catalog timestamp for a table: seconds, no time zone; '-' when unset."""
    return value.strftime("%Y-%m-%d %H:%M:%S") if value else "-"
