"""Maintenance of what jobs leave behind: `tables maintain`."""

from __future__ import annotations

from pathlib import Path

import typer

from pipeline.cli.common import ConfigOption, app, fail, load

tables_app = typer.Typer(no_args_is_help=True, help="What jobs leave behind in the catalog and the Pushgateway.")
app.add_typer(tables_app, name="tables")


@tables_app.command("maintain")
def tables_maintain(
    config: Path = ConfigOption,
    grace_minutes: float = typer.Option(
        15.0, "--grace-minutes", min=0.0, help="Keep the metrics groups of jobs finished less than this long ago."
    ),
) -> None:
    """Delete dead budget reservations, and the Pushgateway groups of jobs finished over the grace ago."""
    from pipeline.job.maintain import maintain

    cfg = load(config)
    try:
        gone = maintain(cfg, grace_minutes * 60)
    except Exception as e:  # an unreachable catalog or Pushgateway: one line, nothing half done that matters
        fail(f"tables maintain: {type(e).__name__}: {e}")
    typer.echo(f"deleted {gone['reservations']} dead budget reservations and {gone['groups']} metrics groups")
