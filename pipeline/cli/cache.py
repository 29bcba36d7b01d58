"""The reuse cache: forget one tenant's outputs (values and near/semantic index segments)."""

from __future__ import annotations

from pathlib import Path

import typer

from pipeline.cli.common import ConfigOption, cache_app, fail, load


@cache_app.command("forget")
def cache_forget(
    config: Path = ConfigOption,
    tenant: str = typer.Option(..., "--tenant", help="The tenant, exactly as its records name it (no pattern)."),
) -> None:
    """Remove exactly one tenant's cached outputs and index segments from the configured cache store."""
    from pipeline.config.env import url_error
    from pipeline.keys import tenant_scope
    from pipeline.stores.cache import connect_store, describe_store

    cfg = load(config)
    where, url = describe_store(cfg.cache), cfg.cache.redis_url if cfg.cache.store == "redis" else None
    try:
        store = connect_store(cfg.cache)
    except Exception as e:  # unreachable, refused, a URL that cannot be parsed
        fail(f"cache {where} unreachable: {url_error(e, url)}")
    try:
        removed = store.forget(tenant_scope(tenant, set()))  # its own scope, even if it is shared now
    except Exception as e:
        fail(f"cache {where} failed: {url_error(e, url)}")
    finally:
        store.close()
    typer.echo(
        f"forgot tenant {tenant!r}: {removed['entries']} entries and {removed['segments']} index segments "
        f"removed from cache {where}"
    )
    if tenant in cfg.dedup.shared_tenants:
        typer.echo(
            f"note: {tenant!r} is in dedup.shared_tenants: outputs it made while shared live in the shared "
            "scope with the other shared tenants' and were kept",
            err=True,
        )
