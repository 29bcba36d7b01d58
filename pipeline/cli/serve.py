"""tokenmill serve (the OpenAI-compatible Batch API) and tokenmill api-key (a tenant's bearer key)."""

from __future__ import annotations

import secrets
from pathlib import Path

import typer

from pipeline.cli.common import ConfigOption, app, console, load
from pipeline.cli.liblog import serve_logging


@app.command("serve")
def serve(
    config: Path = ConfigOption,
    host: str | None = typer.Option(None, "--host", help="Listen address (overrides serve.host)."),
    port: int | None = typer.Option(None, "--port", help="Port (overrides serve.port)."),
) -> None:
    """Serve the OpenAI-compatible Batch API: /v1/files and /v1/batches, each batch run as a tokenmill job."""
    import uvicorn

    from pipeline.serve.app import create_app
    from pipeline.serve.listen import uvicorn_config
    from pipeline.serve.runner import BatchRunner
    from pipeline.serve.store import ApiStore
    from pipeline.stores import storage

    cfg = load(config)
    serve_logging(cfg)
    if not any(t.api_keys for t in cfg.tenants.values()):
        console.print("[yellow]no tenant has an API key (tenants.<name>.api_keys): every call will be refused[/]")
    store = ApiStore(storage.resolve(cfg.output.uri, cfg.storage))
    app = create_app(cfg, store, BatchRunner(cfg, store))  # the app's lifespan starts and closes the runner
    listen = uvicorn_config(app, cfg.serve, host or cfg.serve.host, port or cfg.serve.port, cfg.serve.log_level)
    uvicorn.Server(listen).run()


@app.command("api-key")
def api_key(tenant: str = typer.Option(..., "--tenant", help="The tenant the key acts as.")) -> None:
    """Make a bearer key for `tokenmill serve`: prints the key (give it to the client, once) and the digest to
    put in the config (tenants.<tenant>.api_keys); the key itself is stored nowhere."""
    from pipeline.serve.access import key_digest

    key = f"tm-{secrets.token_urlsafe(32)}"
    console.print(f"key (shown once): {key}")
    console.print(f"config:\n  tenants:\n    {tenant}:\n      api_keys: [{key_digest(key)}]", highlight=False)
