"""The `tokenmill` command: wiring only; every verb calls into the pipeline package."""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import datetime
from pathlib import Path
from typing import Optional

import typer
import yaml
from rich.console import Console
from rich.table import Table

from pipeline.config import ConfigError, load_config, tokenmill_home

# vLLM logs every engine step at INFO; a batch job's own progress lines are what people read.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

app = typer.Typer(add_completion=False, no_args_is_help=True, help="tokenmill: batch LLM summarisation at the lowest cost per document.")
models_app = typer.Typer(no_args_is_help=True, help="Build local models.")
router_app = typer.Typer(no_args_is_help=True, help="Train and calibrate the learned router on your own labels.")
config_app = typer.Typer(no_args_is_help=True, help="Inspect configuration.")
app.add_typer(models_app, name="models")
app.add_typer(router_app, name="router")
app.add_typer(config_app, name="config")
jobs_app = typer.Typer(no_args_is_help=True, help="Jobs in the state catalog.")
app.add_typer(jobs_app, name="jobs")
ledger_app = typer.Typer(no_args_is_help=True, help="Query the cost ledgers (DuckDB over the Parquet files).")
app.add_typer(ledger_app, name="ledger")
# Off a terminal (pipes, Airflow logs) rich would wrap tables at 80 columns; ledgers are wider.
console = Console(width=None if sys.stdout.isatty() else 200)
ConfigOption = typer.Option(..., "--config", "-c", help="YAML config file (e.g. configs/local.yaml).")


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {' '.join(message.split())}", err=True)  # always one line
    raise typer.Exit(code)


def _load(path: Path, **overrides):
    try:
        return load_config(path, **overrides)
    except ConfigError as e:
        _fail(str(e))


@config_app.command("show")
def config_show(config: Path = ConfigOption, format: str = typer.Option("yaml", help="yaml or json")) -> None:
    """Print the effective config: file, then TOKENMILL_<SECTION>__<FIELD> overrides, ${VAR}s expanded."""
    cfg = _load(config)
    data = cfg.model_dump(mode="json")
    typer.echo(json.dumps(data, indent=2) if format == "json" else yaml.safe_dump(data, sort_keys=False))


@config_app.command("docs")
def config_docs() -> None:
    """Print the configuration reference (docs/config.md) generated from the typed config."""
    from pipeline.config import reference_markdown

    typer.echo(reference_markdown(), nl=False)


@models_app.command("tiny")
def models_tiny(path: Optional[Path] = typer.Argument(None, help="Where to write it (default: $TOKENMILL_HOME/models/tiny-<size>)."),
                size: str = typer.Option("small", help="small (about 1.1 M parameters) or large (about 5.5 M).")) -> None:
    """Build a tiny random-weight Llama model offline. Its outputs are gibberish: it exercises the real engine."""
    from pipeline.dev.tiny_model import SIZES, build_tiny_model

    if size not in SIZES:
        _fail(f"--size must be one of {', '.join(SIZES)}")
    target = path or tokenmill_home() / "models" / f"tiny-{size}"
    build_tiny_model(target, size)
    typer.echo(f"built tiny {size} model at {target}")


@models_app.command("embedder")
def models_embedder(path: Optional[Path] = typer.Argument(None, help="Where to write it (default: $TOKENMILL_HOME/models/static-minilm)."),
                    dims: int = typer.Option(256, help="Embedding dimensions kept (PCA).")) -> None:
    """Distil the static embedding model for semantic reuse, offline, from the bundled all-MiniLM-L6-v2 (about 20 s)."""
    from pipeline.dedup.embed import EmbedderError, build_static_embedder

    target = path or tokenmill_home() / "models" / "static-minilm"
    try:
        build_static_embedder(target, dims)
    except EmbedderError as e:
        _fail(str(e))
    typer.echo(f"built static embedder at {target}")


def _router_tiers(cfg) -> tuple[str, str]:
    """(small, large): the cheapest tier and the largest (baseline) tier of the config."""
    prices = cfg.tier_prices
    small = min(prices, key=prices.get)
    if small == cfg.largest_tier:
        _fail("the router needs two tiers of different price in the config")
    return small, cfg.largest_tier


def _cost_per_item(cfg, tier: str, texts: list[str]) -> float:
    """Rough USD per item on a tier: the pre-flight estimate (estimate.py) of a prompt of the labels'
    mean length (≈ chars/4 tokens) at the tier's configured default rate."""
    import pyarrow as pa

    from pipeline.job.estimate import estimate_usd, tier_rates

    prompt = sum(len(x) for x in texts) / max(len(texts), 1) / 4
    return estimate_usd(pa.array([tier]), pa.array([prompt]), cfg, tier_rates(cfg))[0]


@router_app.command("train")
def router_train(config: Path = typer.Option(..., "--config", help="Config whose tiers the router chooses between."),
                 labels: Path = typer.Option(..., "--labels", help="Labelled JSONL (see docs/data-engineer.md)."),
                 out: Optional[Path] = typer.Option(None, "--out", help="Artifact path (default: route.router from the config, else ./router.json)."),
                 target_quality: float = typer.Option(0.95, "--target-quality", help="An item's small-tier output 'suffices' at this share of the large tier's quality.")) -> None:
    """Fit the router on labelled items and write a versioned artifact (then run `router eval` to calibrate it)."""
    from pipeline.route.router import RouterError, read_labels, train

    cfg = _load(config)
    small, large = _router_tiers(cfg)
    try:
        artifact = train(read_labels(labels, small, large), small, large, target_quality)
    except RouterError as e:
        _fail(str(e))
    target = out or Path(cfg.route.router or "router.json")
    target.write_text(json.dumps(artifact, indent=2))
    typer.echo(f"router {artifact['version']} trained on {artifact['trained_on']} items "
               f"({artifact['small_suffices_share']:.0%} fine on {small}) -> {target}")


@router_app.command("eval")
def router_eval(config: Path = typer.Option(..., "--config"),
                labels: Path = typer.Option(..., "--labels", help="Labelled JSONL, ideally not the training set."),
                artifact: Optional[Path] = typer.Option(None, "--router", help="Artifact (default: route.router from the config)."),
                target_quality: float = typer.Option(0.95, "--target-quality", help="Quality to keep, relative to sending everything to the large tier."),
                fmt: str = typer.Option("table", "--format", help="table or json")) -> None:
    """Per threshold: share sent to the large tier, cost per item, quality kept; writes the cheapest threshold meeting the target."""
    from pipeline.route.router import Router, RouterError, evaluate, pick_threshold, read_labels

    cfg = _load(config)
    small, large = _router_tiers(cfg)
    path = artifact or (Path(cfg.route.router) if cfg.route.router else None)
    if path is None:
        _fail("no router artifact: pass --router or set route.router")
    try:
        router, data = Router.load(path), read_labels(labels, small, large)
    except RouterError as e:
        _fail(str(e))
    rows = evaluate(router, data, _cost_per_item(cfg, small, data.texts), _cost_per_item(cfg, large, data.texts))
    best = pick_threshold(rows, target_quality)
    if best is not None:
        router.artifact.update(threshold=best["threshold"], calibrated_quality=best["quality_kept"],
                               calibrated_target=target_quality, calibrated_on=len(data.texts))
        path.write_text(json.dumps(router.artifact, indent=2))
    if fmt == "json":
        typer.echo(json.dumps({"rows": rows, "chosen": best, "target_quality": target_quality}, indent=2))
    else:
        table = Table(title=f"router {router.artifact['version']} on {len(data.texts)} labelled items")
        for col in ("threshold", f"to {large}", "cost/item", "quality kept"):
            table.add_column(col, justify="right")
        for r in rows:
            mark = " <" if best and r["threshold"] == best["threshold"] else ""
            table.add_row(f"{r['threshold']:.2f}{mark}", f"{r['large_share']:.1%}", f"${r['cost_per_item_usd']:.8f}",
                          f"{r['quality_kept']:.1%}")
        console.print(table)
    if best is None:
        _fail(f"no threshold keeps {target_quality:.0%} of all-{large} quality; the artifact keeps its threshold")
    typer.echo(f"threshold {best['threshold']:.2f} written to {path}: {best['large_share']:.1%} to {large}, "
               f"quality kept {best['quality_kept']:.1%}")


@router_app.command("example-labels")
def router_example_labels(path: Path = typer.Argument(..., help="Where to write the JSONL."),
                          items: int = typer.Option(400, help="Number of labelled items.")) -> None:
    """Write a clearly SYNTHETIC labelled set (the format, and something to try train/eval on)."""
    from pipeline.route.router import example_labels

    example_labels(path, items)
    typer.echo(f"wrote {items} synthetic labelled items to {path}")


@app.command("samples")
def samples(path: Path = typer.Argument(..., help="Folder to write the sample corpus into."),
            documents: int = typer.Option(60, help="Number of good documents."),
            bad: bool = typer.Option(True, help="Also write one record of every kind of bad input.")) -> None:
    """Write a small synthetic input corpus (JSONL, JSONL.gz, Parquet, .txt, .md), duplicates included."""
    from pipeline.dev.samples import write_sample_corpus

    counts = write_sample_corpus(path, documents=documents, with_bad_input=bad)
    typer.echo(f"wrote {counts['documents']} documents and {counts['bad_records']} bad records to {path}")


def _prefix_line(p: dict) -> str:
    if not p or p.get("hit_ratio") is None:
        return "-"
    return f"{p['hit_ratio']:.1%} of prompt tokens cached; sharing allows {p['shareable_ratio']:.1%}"


def summary_table(manifest: dict) -> Table:
    c, t, m = manifest["counts"], manifest["tokens"], manifest["cost"]
    table = Table(title=f"job {manifest['job_id']}", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    reused = c["outputs"] - c["by_source"].get("generated", 0)
    rows = [
        ("records", c["records"]), ("generated", c["by_source"].get("generated", 0)), ("reused", reused),
        *((f"  {src.replace('_', ' ')}", f"{r['items']} ({r['rate']:.1%}), saved ${r['saved_usd']:.6f}")
          for src, r in manifest.get("reuse", {}).get("by_source", {}).items()),
        ("quarantined", c["quarantined"]),
        ("  by reason", ", ".join(f"{k} {v}" for k, v in c["by_reason"].items()) or "-"),
        ("  by tier", ", ".join(f"{k} {v}" for k, v in c.get("by_tier", {}).items()) or "-"),
        ("  by route", ", ".join(f"{k} {v}" for k, v in manifest.get("routing", {}).get("by_reason", {}).items()) or "-"),
        ("  escalated / chunked", f"{manifest.get('routing', {}).get('escalated', 0)} / "
                                  f"{manifest.get('routing', {}).get('chunked', 0)}"),
        ("prompt tokens (cached)", f"{t['prompt_tokens']} ({t['cached_prompt_tokens']})"),
        ("prefix cache", _prefix_line(manifest.get("prefix_cache", {}))),
        ("output tokens", t["output_tokens"]),
        ("GPU-seconds", f"{m['gpu_seconds']:.3f}"),
        ("cost", f"${m['cost_usd']:.6f}"), ("baseline cost", f"${m['baseline_cost_usd']:.6f}"),
        ("saved vs baseline", f"${m['saved_usd']:.6f}"),
    ]
    v = manifest.get("reuse", {}).get("verification", {})
    if v.get("checked"):
        rows.append(("reuse false-hit rate", f"{v['false_hit_rate']:.1%} of {v['checked']} verified "
                                             f"(95% CI {v['ci95'][0]:.1%}-{v['ci95'][1]:.1%})"))
    if manifest.get("reuse", {}).get("cache_status", {}).get("bypassed"):
        rows.append(("cache", f"bypassed for {manifest['reuse']['cache_status']['bypassed']} items (store unreachable)"))
    for tier, e in manifest["engines"].items():
        tps, eff = e["output_tokens_per_second"], e.get("efficiency") or {}
        line = f"{e['engine_seconds']:.2f} s engine, {tps:.0f} output tok/s" if tps else "-"
        if eff.get("mfu") is not None:
            line += f", MFU {eff['mfu']:.1%}, MBU {eff['mbu']:.1%} ({eff['gpu_model']})"
        rows.append((f"tier {tier}", line))
    for k, v in rows:
        table.add_row(k, str(v))
    return table


def _run(cfg, job_id: Optional[str], partitions: list[str] | None, json_summary: bool) -> None:
    from pipeline.generate.engine import shutdown_engines
    from pipeline.job.progress import Progress
    from pipeline.job.lifecycle import JobError, run_job

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for noisy in ("vllm", "transformers", "httpx", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        result = run_job(cfg, job_id=job_id, partitions=partitions,
                         progress=Progress(cfg.run.progress, cfg.run.log_every_seconds))
    except JobError as e:
        # Exit 3: stopped by a budget cap (refused, or partitions deferred); 2: any other failure.
        _fail(f"job {'stopped' if e.budget else 'failed'}: {e}", code=3 if e.budget else 2)
    finally:
        shutdown_engines()
    if json_summary:
        typer.echo(json.dumps(result.manifest, indent=2))
    else:
        console.print(summary_table(result.manifest))
        console.print(f"outputs, ledger and quarantine under {cfg.output.uri}; manifest: jobs/{result.job_id}/manifest.json")


@app.command("run")
def run(config: Path = ConfigOption,
        input: Optional[str] = typer.Option(None, "--input", help="Input folder or URI (overrides input.uri)."),
        output: Optional[str] = typer.Option(None, "--output", help="Output root (overrides output.uri)."),
        job_id: Optional[str] = typer.Option(None, "--job-id", help="Job id (default: job-<UTC time>-<random>). An existing id continues that job."),
        json_summary: bool = typer.Option(False, "--json", help="Print the manifest as JSON instead of a table.")) -> None:
    """Run a summarisation job end to end. Exit 0 when every partition committed (quarantined records included)."""
    _run(_load(config, input__uri=input, output__uri=output), job_id, None, json_summary)


@app.command("rerun")
def rerun(config: Path = ConfigOption,
          job_id: str = typer.Option(..., "--job-id", help="The job to continue."),
          partition: Optional[list[str]] = typer.Option(None, "--partition", help="Run these partitions again even if they succeeded (repeatable)."),
          json_summary: bool = typer.Option(False, "--json", help="Print the manifest as JSON.")) -> None:
    """Re-run a job's failed and unfinished partitions (or the named ones). Committed work is never paid twice."""
    cfg = _load(config)
    job = _state(cfg).job(job_id)
    if job is None:
        _fail(f"no job {job_id} in {_state(cfg).safe_url(cfg.state.url)}")
    # A rerun reads and writes where the job was planned, whatever the config file says now.
    cfg = _load(config, input__uri=job.input_uri, output__uri=job.output_uri)
    _run(cfg, job_id, partition or [], json_summary)


def _state(cfg):
    from pipeline.stores.catalog import StateError, StateStore

    try:
        return StateStore(cfg.state.url)
    except StateError as e:
        _fail(str(e))


def _when(value) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if value else "-"


@app.command("status")
def status(config: Path = ConfigOption, job_id: str = typer.Option(..., "--job-id"),
           format: str = typer.Option("table", "--format", help="table or json")) -> None:
    """A job's partitions: status, attempts, worker, last error, counts."""
    state = _state(_load(config))
    job = state.job(job_id)
    if job is None:
        _fail(f"no job {job_id}")
    parts = state.partitions(job_id)
    if format == "json":
        typer.echo(json.dumps({
            "job_id": job.job_id, "status": job.status, "error": job.error,
            "partitions": [{"partition": p.partition, "file": p.file, "records": p.records, "status": p.status,
                            "attempts": p.attempts, "worker": p.worker, "last_error": p.last_error,
                            "started_at": _when(p.started_at), "finished_at": _when(p.finished_at),
                            "counts": json.loads(p.counts) if p.counts else None} for p in parts]}, indent=2))
        return
    table = Table(title=f"job {job.job_id}: {job.status}" + (f" ({job.error})" if job.error else ""))
    for col in ("partition", "file", "records", "status", "attempts", "outputs", "quarantined", "cost $", "worker", "last error"):
        table.add_column(col)
    for p in parts:
        counts = json.loads(p.counts) if p.counts else {}
        table.add_row(p.partition, p.file, str(p.records), p.status, str(p.attempts), str(counts.get("outputs", "-")),
                      str(counts.get("quarantined", "-")), f"{counts['cost_usd']:.6f}" if counts else "-",
                      p.worker or "-", (p.last_error or "")[:80])
    console.print(table)


@jobs_app.command("list")
def jobs_list(config: Path = ConfigOption, format: str = typer.Option("table", "--format", help="table or json")) -> None:
    """Every job in the state catalog, newest first."""
    jobs = _state(_load(config)).jobs()
    rows = [{"job_id": j.job_id, "status": j.status, "created_at": _when(j.created_at), "finished_at": _when(j.finished_at),
             "records": (json.loads(j.counts) if j.counts else {}).get("records"), "output_uri": j.output_uri,
             "error": j.error} for j in jobs]
    if format == "json":
        typer.echo(json.dumps(rows, indent=2))
        return
    table = Table()
    for col in ("job_id", "status", "created_at", "finished_at", "records", "output_uri", "error"):
        table.add_column(col)
    for r in rows:
        table.add_row(*(str(r[k]) if r[k] is not None else "-" for k in r))
    console.print(table)


def _print_table(table, format: str, title: str | None = None) -> None:
    """An Arrow table as a rich table, CSV or JSON on stdout."""
    from decimal import Decimal

    if format == "csv":
        import io

        import pyarrow.csv as pacsv

        buf = io.BytesIO()
        pacsv.write_csv(table, buf)
        text = buf.getvalue().decode()
        typer.echo(text if text.endswith("\n") else text + "\n", nl=False)
        return
    rows = table.to_pylist()
    if format == "json":
        def plain(v):
            return float(v) if isinstance(v, Decimal) else v.isoformat() if hasattr(v, "isoformat") else v

        typer.echo(json.dumps([{k: plain(v) for k, v in r.items()} for r in rows], indent=2))
        return
    if format != "table":
        _fail(f"--format must be table, csv or json, not {format}")
    out = Table(title=title)
    for name in table.column_names:
        out.add_column(name, justify="left" if table.schema.field(name).type in ("string",) else "right")
    for r in rows:
        out.add_row(*("-" if v is None else f"{v:.6f}" if isinstance(v, (float, Decimal)) else str(v) for v in r.values()))
    console.print(out)


def _ledger(output: str, config: Optional[Path]):
    from pipeline.config import StorageConfig
    from pipeline.output.ledger import connect
    from pipeline.stores.storage import StorageError

    storage_config = _load(config).storage if config else StorageConfig()
    try:
        return connect(output, storage_config)
    except StorageError as e:
        _fail(str(e))


OutputOption = typer.Option(..., "--output", help="Output root holding ledger/, outputs/, quarantine/ (local or s3://).")
LedgerConfigOption = typer.Option(None, "--config", "-c", help="Config for storage settings (S3 endpoint, region).")
FormatOption = typer.Option("table", "--format", help="table, csv or json")


@ledger_app.command("summary")
def ledger_summary(output: str = OutputOption,
                   by: str = typer.Option("tenant,tier", "--by", help="Comma-separated: tenant, tier, model, source, job, partition, day (or '' for one total row)."),
                   job_id: Optional[str] = typer.Option(None, "--job-id", help="Only this job."),
                   since: Optional[datetime] = typer.Option(None, "--since", formats=["%Y-%m-%d"], help="From this day (UTC), inclusive."),
                   until: Optional[datetime] = typer.Option(None, "--until", formats=["%Y-%m-%d"], help="To this day (UTC), inclusive."),
                   format: str = FormatOption, config: Optional[Path] = LedgerConfigOption) -> None:
    """Items, tokens, GPU-seconds, cost, baseline and saving, grouped as asked."""
    from pipeline.output.ledger import LedgerError, summary

    keys = [b.strip() for b in by.split(",") if b.strip()]
    try:
        table = summary(_ledger(output, config), keys, job_id, since.date() if since else None,
                        until.date() if until else None)
    except LedgerError as e:
        _fail(str(e))
    _print_table(table, format, title="ledger summary")


@ledger_app.command("sql")
def ledger_sql(sql: str = typer.Argument(..., help="A query over the views ledger, outputs and quarantine."),
               output: str = OutputOption, format: str = FormatOption, config: Optional[Path] = LedgerConfigOption) -> None:
    """Run SQL (DuckDB) over the ledger, outputs and quarantine of an output root."""
    from pipeline.output.ledger import LedgerError, query

    try:
        table = query(_ledger(output, config), sql)
    except LedgerError as e:
        _fail(str(e))
    _print_table(table, format)


@app.command("plan")
def plan(config: Path = ConfigOption,
         input: Optional[str] = typer.Option(None, "--input", help="Input folder or URI (overrides input.uri)."),
         format: str = typer.Option("table", "--format", help="table or json")) -> None:
    """Pre-flight: records, duplicates, share per tier, tokens and dollars, before any GPU work."""
    from pipeline.job.estimate import budget_problems, estimate_job
    from pipeline.generate.engine import EnginePool, EngineStartError
    from pipeline.stores.storage import StorageError

    cfg = _load(config, input__uri=input)
    try:
        est = estimate_job(cfg, EnginePool(cfg.tiers))
    except (StorageError, EngineStartError) as e:
        _fail(str(e))
    est["budget_problems"] = budget_problems(cfg, est["est_usd"], est["tenants"]) if cfg.budget.active else []
    if format == "json":
        typer.echo(json.dumps(est, indent=2))
        return
    table = Table(title=f"pre-flight estimate for {cfg.input.uri}", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    for k in ("records", "quarantined", "duplicates", "to_generate"):
        table.add_row(k.replace("_", " "), str(est[k]))
    for name, t in est["tiers"].items():
        table.add_row(f"tier {name}", f"{t['items']} items ({t['share']:.0%}), {t['prompt_tokens']} prompt tokens, "
                                      f"~{t['est_output_tokens']:.0f} output tokens, ~${t['est_usd']:.6f}")
        table.add_row("  estimated from", t["method"])
    for tenant, usd in est["tenants"].items():
        table.add_row(f"tenant {tenant}", f"~${usd:.6f}")
    table.add_row("estimated cost", f"~${est['est_usd']:.6f}")
    table.add_row("budget", "; ".join(est["budget_problems"]) or ("within caps" if cfg.budget.active else "no caps set"))
    console.print(table)
    console.print(est["note"])


@app.command("report")
def report(output: str = OutputOption, job_id: str = typer.Option(..., "--job-id"),
           out: Path = typer.Option(..., "--out", help="HTML file to write (self-contained: opens offline)."),
           config: Optional[Path] = LedgerConfigOption) -> None:
    """Write a job's cost report: cost by tenant and tier, savings waterfall, throughput, reuse, slowest partitions."""
    from pipeline.config import StorageConfig
    from pipeline.output.report import build_report
    from pipeline.stores.storage import StorageError

    try:
        page = build_report(output, job_id, _load(config).storage if config else StorageConfig())
    except StorageError as e:
        _fail(str(e))
    out.write_text(page, encoding="utf-8")
    typer.echo(f"wrote {out}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
