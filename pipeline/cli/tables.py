"""The catalog's schema and what jobs leave behind: `migrate`, `tables maintain` (the output tables, the catalog,
the Pushgateway) and `tables migrate` (an output root of the layout before Delta tables)."""

from __future__ import annotations

from pathlib import Path

import typer

from pipeline.cli.common import ConfigOption, app, fail, load, migrate_catalog

tables_app = typer.Typer(
    no_args_is_help=True, help="What jobs leave behind: the output's Delta tables, the catalog and the Pushgateway."
)
app.add_typer(tables_app, name="tables")


@app.command("migrate")
def migrate(config: Path = ConfigOption) -> None:
    """Bring the state catalog (state.url) to the latest schema. Commands that write do it first themselves;
    run it once before an upgraded version's workers start, so that none of them waits on it."""
    cfg = load(config)
    migrate_catalog(cfg)
    typer.echo("the state catalog is at the latest schema")


@tables_app.command("maintain")
def tables_maintain(
    config: Path = ConfigOption,
    grace_minutes: float = typer.Option(
        15.0, "--grace-minutes", min=0.0, help="Keep the metrics groups of jobs finished less than this long ago."
    ),
) -> None:
    """Compact the output tables' small files and vacuum files older than `output.vacuum_retention_hours` that no
    version names (safe while a job commits); delete dead budget reservations, and the Pushgateway groups of jobs
    finished over the grace ago."""
    from pipeline.job.maintain import maintain
    from pipeline.output.tables import maintain as maintain_tables
    from pipeline.stores import storage

    cfg = load(config)
    try:
        root = storage.resolve(cfg.output.uri, cfg.storage)
        tables = maintain_tables(root, cfg.output.vacuum_retention_hours, cfg.output.compact_target_mb)
        gone = maintain(cfg, grace_minutes * 60)
    except Exception as e:  # an unreachable store, catalog or Pushgateway: one line, nothing half done that matters
        fail(f"tables maintain: {type(e).__name__}: {e}")
    for kind, done in tables.items():
        typer.echo(
            f"{kind}: compacted {done['files_removed']} files into {done['files_added']}, "
            f"vacuumed {done['files_deleted']}; {done['files']} files now"
        )
    typer.echo(f"deleted {gone['reservations']} dead budget reservations and {gone['groups']} metrics groups")


@tables_app.command("migrate")
def tables_migrate(
    output: str = typer.Option(..., "--output", help="Output root written before Delta tables (local or s3://)."),
    config: Path = typer.Option(None, "--config", "-c", help="Config for storage settings (S3 endpoint, region)."),
) -> None:
    """Convert an output root with commit records (`_commits/`) into Delta tables, once: run again, it skips
    what it converted; jobs refuse the root until it is done."""
    from pipeline.config import StorageConfig
    from pipeline.output.migrate import migrate
    from pipeline.stores import storage

    storage_config = load(config).storage if config else StorageConfig()
    try:
        done = migrate(storage.resolve(output, storage_config))
    except Exception as e:
        fail(f"tables migrate: {type(e).__name__}: {e}")
    typer.echo(
        f"converted {done['partitions']} partitions ({done['skipped']} converted before); "
        f"deleted {done['files_deleted']} files of the old layout"
    )
