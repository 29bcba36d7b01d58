"""Jobs: run, rerun, the pre-flight estimate, and what the state catalog says about jobs."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table
from rich.text import Text

from pipeline import JobError, estimate_job, run_job
from pipeline.cli.common import ConfigOption, app, console, fail, jobs_app, load, migrate_catalog, state_store, when
from pipeline.cli.liblog import library_output
from pipeline.config.env import redact_url
from pipeline.generate.quality import CHECKS
from pipeline.output.manifest import EngineFigures, JobCounts, JudgeCounts, Manifest, PartitionCounts
from pipeline.output.telemetry import device_name

InputOption = typer.Option(None, "--input", help="Input folder or URI (overrides input.uri).")
VerboseOption = typer.Option(
    False,
    "--verbose",
    "-v",
    help=(
        "Print the engines' and libraries' messages (vLLM, torch, transformers) here too, "
        "instead of only to the log file under $TOKENMILL_HOME/logs."
    ),
)


def prefix_line(manifest: Manifest) -> str:
    """The prefix cache's hit share next to what sharing allows, and why when nothing was hit."""
    p = manifest.prefix_cache
    if p.hit_ratio is None:
        return "-"
    line = f"{p.hit_ratio:.1%} of prompt tokens cached; sharing allows {p.shareable_ratio:.1%}"
    if p.hit_ratio > 0 or not p.shareable_ratio:
        return line
    engines = manifest.engines
    if engines and not any(e.levers.get("prefix_caching", True) for e in engines.values()):
        return f"{line} (prefix caching is off: tiers.<name>.vllm.enable_prefix_caching)"
    requests = manifest.counts.by_source.get("generated", 0)
    shared = manifest.tokens.shareable_prompt_tokens / requests if requests else 0
    return (
        f"{line} (about {shared:.0f} tokens shared per prompt; vLLM caches whole blocks, 128 tokens on a CPU, "
        "16 on a GPU: a shared prefix shorter than a block is never hit)"
    )


def engine_line(e: EngineFigures) -> str:
    """One tier's engine time in a job: starts, held seconds (start-up, busy, idle), utilisation (busy ÷ held),
    then throughput and hardware efficiency."""
    parts = []
    if e.held_seconds is not None:
        util = e.utilisation
        parts.append(
            f"{e.starts} start{'' if e.starts == 1 else 's'}, "
            f"{e.held_seconds:.1f} s held (start-up {e.startup_seconds:.1f}, "
            f"busy {e.busy_seconds:.1f}, idle {e.idle_seconds:.1f}), "
            f"utilisation {'-' if util is None else f'{util:.0%}'}"
        )
    tps, eff = e.output_tokens_per_second, e.efficiency
    if tps:
        parts.append(f"{tps:.0f} output tok/s")
    if eff.get("mfu") is not None:
        parts.append(f"MFU {eff['mfu']:.1%}, MBU {eff['mbu']:.1%} (of {device_name(eff)})")
    if e.failed_attempts:
        n = e.failed_attempts
        parts.append(f"{n} failed attempt{'' if n == 1 else 's'}")
    return ", ".join(parts) or "-"


def _engine_rows(manifest: Manifest) -> list[tuple[str, str]]:
    return [(f"tier {tier}", engine_line(e)) for tier, e in manifest.engines.items()]


def _acceptable_line(manifest: Manifest) -> str:
    """Served outputs that failed no check, and what the job paid per such summary."""
    acceptable, outputs = sum(manifest.acceptable.values()), manifest.counts.outputs
    if not outputs:
        return "-"
    per = f", ${manifest.cost.cost_usd / acceptable:.6f} per acceptable summary" if acceptable else ""
    return f"{acceptable} of {outputs} ({acceptable / outputs:.0%}){per}"


def judge_line(judge: JudgeCounts) -> str:
    """The LLM judge's verdicts (checks.judge) and what the ones this job paid for cost, in one line."""
    verdicts = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in judge.verdicts.items())
    return f"{judge.judged} judged ({verdicts}); {judge.paid} paid, ${judge.cost_usd:.6f}"


def routing_line(manifest: Manifest, decided_by: str | None = None) -> str:
    """How the outputs were shared between tiers, in one line: each tier's share and the escalations, or that
    every output went to one tier; then what chose the routing (`route.decided_by`: the eval's figure)."""
    by_tier, outputs = manifest.counts.by_tier, manifest.counts.outputs
    if not outputs:
        return "-"
    if len(by_tier) == 1:
        line = f"every output on {next(iter(by_tier))}"
    else:
        shares = ", ".join(f"{tier} {n / outputs:.0%}" for tier, n in by_tier.items())
        line = f"{shares}; {manifest.routing.escalated} escalated"
    return f"{line}: {decided_by}" if decided_by else line


def summary_table(manifest: Manifest, decided_by: str | None = None) -> Table:
    """A job manifest as the table `tokenmill run` prints (`decided_by`: the config's `route.decided_by`)."""
    c, t, m = manifest.counts, manifest.tokens, manifest.cost
    reuse, routing = manifest.reuse, manifest.routing
    table = Table(title=f"job {manifest.job_id}", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    generated = c.by_source.get("generated", 0)
    rows = [
        ("records", c.records),
        ("generated", generated),
        ("reused", c.outputs - generated),
        *(
            (f"  {src.replace('_', ' ')}", f"{r.items} ({r.rate:.1%}), saved ${r.saved_usd:.6f}")
            for src, r in reuse.by_source.items()
        ),
        ("quarantined", c.quarantined),
        ("  by reason", ", ".join(f"{k} {v}" for k, v in c.by_reason.items()) or "-"),
        ("  by tier", ", ".join(f"{k} {v}" for k, v in c.by_tier.items()) or "-"),
        ("  routing", routing_line(manifest, decided_by)),
        ("  by route", ", ".join(f"{k} {v}" for k, v in routing.by_reason.items()) or "-"),
        ("  escalated / chunked", f"{routing.escalated} / {routing.chunked}"),
        ("  escalated by", ", ".join(f"{k} {v}" for k, v in routing.escalated_by.items()) or "-"),
        ("unfaithful outputs", ", ".join(f"{k} {v}" for k, v in manifest.unfaithful.outputs.items()) or "none"),
        *(
            (f"{check.replace('_', ' ')} outputs", ", ".join(f"{k} {v}" for k, v in by_tier.items()) or "none")
            for check, by_tier in manifest.checks.items()
        ),
        ("acceptable outputs", _acceptable_line(manifest)),
        ("prompt tokens (cached)", f"{t.prompt_tokens} ({t.cached_prompt_tokens})"),
        ("prefix cache", prefix_line(manifest)),
        ("output tokens", t.output_tokens),
        (
            "GPU-seconds",
            f"{m.gpu_seconds:.3f}"
            + (f" ({m.overhead_gpu_seconds:.3f} engine start-up and idle)" if m.overhead_gpu_seconds else ""),
        ),
        ("cost", f"${m.cost_usd:.6f}"),
        ("baseline cost", f"${m.baseline_cost_usd:.6f}"),
        ("saved vs baseline", f"${m.saved_usd:.6f}"),
    ]
    v = reuse.verification
    if v.get("checked"):
        rows.append(
            (
                "reuse false-hit rate",
                f"{v['false_hit_rate']:.1%} of {v['checked']} verified (95% CI {v['ci95'][0]:.1%}-{v['ci95'][1]:.1%})",
            )
        )
    if reuse.cache_status.get("bypassed"):
        rows.append(("cache", f"bypassed for {reuse.cache_status['bypassed']} items (store unreachable)"))
    if manifest.judge.judged:
        rows.append(("LLM judge", judge_line(manifest.judge)))
    rows += _engine_rows(manifest)
    for k, v in rows:
        table.add_row(k, str(v))
    return table


# What an example shows, in the order examples are chosen: a summary a user would keep, then one caught by
# each output check (docs/data-engineer.md#output-checks), then any other.
SHOWS = ("acceptable", *CHECKS, "unfaithful", "truncated", "other")


def examples(cfg, job_id: str, n: int = 3) -> list[dict]:
    """A few outputs of the job (generated or reused) for a reader to judge by eye, chosen to show the checks at
    work: the first acceptable one, then the first caught by each check, then the next of each; n rows read."""
    from pipeline.output.ledger import connect

    shows = (
        "CASE "
        + " ".join(f"WHEN l.{c} THEN '{c}'" for c in SHOWS if c not in ("truncated", "other"))
        + " WHEN o.finish_reason = 'length' THEN 'truncated' ELSE 'other' END"
    )
    rank = "CASE shows " + " ".join(f"WHEN '{c}' THEN {i}" for i, c in enumerate(SHOWS)) + " END"
    rows = (
        connect(cfg.output.uri, cfg.storage)
        .execute(
            "SELECT id, tier, summary, escalated, shows "
            f"FROM (SELECT o.id, o.tier, o.summary, l.escalated, {shows} AS shows "
            "FROM outputs o JOIN ledger l USING (job_id, id) WHERE o.job_id = ? AND l.kind = 'output') "
            f"ORDER BY row_number() OVER (PARTITION BY shows ORDER BY id), {rank}, id LIMIT ?",
            [job_id, n],
        )
        .fetchall()
    )
    out = [{"id": r[0], "tier": r[1], "summary": r[2], "escalated": r[3], "shows": r[4]} for r in rows]
    if out and out[0]["shows"] == "acceptable":
        out[0] = _keepable(cfg, job_id) or out[0]
    return out


def _keepable(cfg, job_id: str, read: int = 500) -> dict | None:
    """Of the job's acceptable outputs (the first `read` by id), the one a reader would most likely keep
    (quality.keep_rank: no phrase repeated, no prompt or markup given back, the most topic words)."""
    from pipeline.generate.quality import keep_rank
    from pipeline.output.ledger import connect

    rows = (
        connect(cfg.output.uri, cfg.storage)
        .execute(
            "SELECT o.id, o.tier, o.summary, l.escalated FROM outputs o JOIN ledger l USING (job_id, id) "
            "WHERE o.job_id = ? AND l.kind = 'output' AND l.acceptable ORDER BY o.id LIMIT ?",
            [job_id, read],
        )
        .fetchall()
    )
    if not rows:
        return None
    best = max(rows, key=lambda r: keep_rank(r[2] or ""))  # max keeps the first of equals: the first id
    return {"id": best[0], "tier": best[1], "summary": best[2], "escalated": best[3], "shows": "acceptable"}


def _example_line(e: dict) -> Text:
    summary = " ".join(e["summary"].split())
    verdict = {"acceptable": "acceptable", "other": None}.get(e["shows"], f"flagged {e['shows'].replace('_', ' ')}")
    about = ", ".join(x for x in (e["tier"], "escalated" if e["escalated"] else None, verdict) if x)
    return Text.assemble((e["id"], "bold"), f" ({about}): {summary[:300]}{'…' if len(summary) > 300 else ''}")


def _run(cfg, job_id: Optional[str], partitions: list[str] | None, json_summary: bool, verbose: bool) -> None:
    from pipeline.config import tokenmill_home
    from pipeline.generate.engine import shutdown_engines
    from pipeline.job.progress import Progress

    with library_output(tokenmill_home(), verbose) as log_file:
        for noisy in ("vllm", "transformers", "httpx", "alembic"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
        if log_file is not None:
            logging.getLogger("tokenmill.run").info(
                "engine and library messages (vLLM, torch): %s (-v: here)", log_file
            )
        try:
            # release_engines: each tier's engine is shut down when its drain ends (this process ends after the
            # job), so its memory is free for the next tier and every second it was held is in the ledger.
            result = run_job(
                cfg,
                job_id=job_id,
                partitions=partitions,
                release_engines=True,
                progress=Progress(cfg.run.progress, cfg.run.log_every_seconds),
            )
        except JobError as e:
            # Exit 3: stopped by a budget cap (refused, or partitions deferred); 2: any other failure.
            fail(f"job {'stopped' if e.budget else 'failed'}: {e}", code=3 if e.budget else 2)
        finally:
            shutdown_engines()
            from pipeline.generate import metrics

            metrics.linger(cfg.metrics)  # a served endpoint's final values, scraped before the process exits
    if json_summary:
        typer.echo(json.dumps(result.manifest.as_json(), indent=2))
    else:
        console.print(summary_table(result.manifest, cfg.route.decided_by))
        for e in examples(cfg, result.job_id):
            console.print(_example_line(e))
        console.print(
            f"outputs, ledger and quarantine under {cfg.output.uri}; manifest: jobs/{result.job_id}/manifest.json"
        )


@app.command("run")
def run(
    config: Path = ConfigOption,
    input: Optional[str] = InputOption,
    output: Optional[str] = typer.Option(None, "--output", help="Output root (overrides output.uri)."),
    job_id: Optional[str] = typer.Option(
        None, "--job-id", help="Job id (default: job-<UTC time>-<random>). An existing id continues that job."
    ),
    json_summary: bool = typer.Option(False, "--json", help="Print the manifest as JSON instead of a table."),
    verbose: bool = VerboseOption,
) -> None:
    """Run a summarisation job end to end. Exit 0 when every partition committed (quarantined records included)."""
    _run(load(config, input__uri=input, output__uri=output), job_id, None, json_summary, verbose)


@app.command("rerun")
def rerun(
    config: Path = ConfigOption,
    job_id: str = typer.Option(..., "--job-id", help="The job to continue."),
    partition: Optional[list[str]] = typer.Option(
        None, "--partition", help="Run these partitions again even if they succeeded (repeatable)."
    ),
    json_summary: bool = typer.Option(False, "--json", help="Print the manifest as JSON."),
    verbose: bool = VerboseOption,
) -> None:
    """Re-run a job's failed and unfinished partitions (or the named ones). Committed work is never paid twice."""
    cfg = load(config)
    migrate_catalog(cfg)  # a rerun writes: the catalog's schema first, as `run`'s
    state = state_store(cfg)
    job = state.job(job_id)
    if job is None:
        fail(f"no job {job_id} in {state.safe_url(cfg.state.url)}")
    # A rerun reads and writes where the job was staged, whatever the config file says now.
    cfg = load(config, input__uri=job.input_uri, output__uri=job.output_uri)
    _run(cfg, job_id, partition or [], json_summary, verbose)


def _usd_range(e: dict) -> str:
    """An estimate's midpoint and range, e.g. `~$0.012000 ($0.009000-$0.018000)`."""
    return f"~${e['est_usd']:.6f} (${e['est_usd_low']:.6f}-${e['est_usd_high']:.6f})"


def _estimate_table(cfg, est: dict) -> Table:
    table = Table(title=f"pre-flight estimate for {cfg.input.uri}", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    for k in ("records", "quarantined", "duplicates", "to_generate"):
        table.add_row(k.replace("_", " "), str(est[k]))
    for name, t in est["tiers"].items():
        table.add_row(
            f"tier {name}",
            f"{t['items']} items ({t['share']:.0%}), {t['prompt_tokens']} prompt tokens, "
            f"~{t['est_output_tokens']:.0f} output tokens, {_usd_range(t)}",
        )
        if t.get("escalation"):
            e = t["escalation"]
            table.add_row(
                "  escalations",
                f"~{e['items']:.1f} to {e['to']} ({e['rate']:.0%}, {e['rate_low']:.0%}-"
                f"{e['rate_high']:.0%}), {_usd_range(e)}",
            )
        if t.get("escalated_in"):
            e = t["escalated_in"]
            table.add_row("  escalated in", f"~{e['items']:.1f} items ({e['items_low']:.1f}-{e['items_high']:.1f})")
        if t.get("engine_overhead", {}).get("est_usd_high"):
            o = t["engine_overhead"]
            table.add_row("  engine start-up and idle", f"~{o['gpu_seconds']:.1f} GPU-seconds, {_usd_range(o)}")
        table.add_row("  estimated from", t["method"])
    for tenant, usd in est["tenants"].items():
        r = est.get("tenant_ranges", {}).get(tenant)
        table.add_row(f"tenant {tenant}", _usd_range(r) if r else f"~${usd:.6f}")
    table.add_row("estimated cost", _usd_range(est) if "est_usd_low" in est else f"~${est['est_usd']:.6f}")
    table.add_row(
        "budget",
        "; ".join(est["budget_problems"])
        or ("within caps (checked at the midpoint)" if cfg.budget.active else "no caps set"),
    )
    return table


def _projection_table(p: dict) -> Table:
    """The what-if projection (plan/whatif.py), titled as one."""
    prices = ", ".join(f"{t} ${usd:g}" for t, usd in p["price_per_gpu_hour"].items())
    table = Table(title=f"projection (not measured) on {p['hardware']}, per GPU-hour: {prices}")
    # A lever's effect: the tier's busy time with it against without it (negative: it saves).
    for column in ("tier", "model", "engine-hours", "GPU-hours", "USD", "projected effect of each lever"):
        table.add_column(
            column, justify="left" if column in ("tier", "model", "projected effect of each lever") else "right"
        )
    for name, t in p["tiers"].items():
        effects = ", ".join(
            f"{lever}{' (on)' if e['on'] else ''} {-e['saving']:+.0%}"
            + (f" @{e['acceptance']:.0%}" if "acceptance" in e else "")
            for lever, e in t["levers_effect"].items()
        )
        table.add_row(
            name,
            f"{t['model']} ({t['parameters'] / 1e9:.2f} B)",
            f"{t['engine_hours']:.3g}",
            f"{t['gpu_hours']:.3g}",
            f"${t['usd']:.4f}",
            effects,
        )
    table.add_row("all", "", "", "", f"${p['usd']:.4f}", "")
    for share, s in p["shares"].items():
        table.add_row(
            f"{share} share", "", "", "", f"${s['usd_without']:.4f} without", f"{-s['saving']:+.0%} as planned"
        )
    for api, usd in p["api_batch_usd"].items():
        table.add_row("same tokens", api, "", "", f"${usd:.4f}", f"list price, {p['api_prices_date']}")
    return table


def _documents(n: float | None) -> str:
    return "never (the API costs less per document)" if n is None else f"{n:,.0f} documents/night"


def _break_even_table(b: dict) -> Table:
    """The break-even against each API batch offer (plan/breakeven.py), per tier mix, and what each figure is."""
    volume = b["volume_documents_per_night"]
    table = Table(title=f"break-even (projection, not measured) at {volume:,} documents/night")
    for column in ("tier mix", "$/1k docs", "against", "break-even volume", f"ratio at {volume:,}"):
        table.add_column(column, justify="left" if column in ("tier mix", "against") else "right")
    for mix, m in b["mixes"].items():
        table.add_row(
            f"{mix} ({', '.join(m['tiers'])})",
            f"${m['usd_per_1k_documents_at_volume']:.4f} at {volume:,}; "
            f"${m['usd_per_1k_documents_at_job']:.4f} at this job's {b['job_documents']:,}",
            f"start-ups (or billed hours) ${m['fixed_usd_per_night']:.4f}/night",
            f"{m['gpu_hours_per_night_at_volume']:.3g} GPU-hours/night"
            + ("" if m["fits_a_night"] else " (over 24 h a GPU: give more GPUs)"),
            "",
        )
        for api, a in m["api"].items():
            ratio = a["ratio_at_volume"]
            table.add_row(
                "",
                f"${a['usd_per_1k_documents']:.4f}",
                api,
                _documents(a["break_even_documents"]),
                "-" if ratio is None else f"{ratio:.2f}× the API",
            )
    return table


@app.command("estimate")
def estimate(
    config: Path = ConfigOption,
    input: Optional[str] = InputOption,
    format: str = typer.Option("table", "--format", help="table or json"),
    hardware: Optional[str] = typer.Option(
        None, "--hardware", help="What-if: project the job on GPUs it does not have, e.g. H100-SXM:8 (per tier)."
    ),
    tier: Optional[list[str]] = typer.Option(
        None,
        "--tier",
        help="What-if: a tier's model and levers, NAME=MODEL[:fp8|:int4|:kv-fp8|:spec=ACCEPTANCE] (a preset such "
        "as Llama-3.1-70B, or a model folder); repeatable. Unnamed tiers keep their configured model.",
    ),
    price_per_gpu_hour: Optional[float] = typer.Option(
        None, "--price-per-gpu-hour", help="What-if: USD per GPU-hour (default: each tier's configured price)."
    ),
    api_prices: Optional[Path] = typer.Option(
        None,
        "--api-prices",
        help="What-if: batch API prices, a JSON file as pipeline/plan/api_prices.json (USD per 1M tokens).",
    ),
    volume: Optional[str] = typer.Option(
        None, "--volume", help="What-if: documents per night, e.g. 1000000 or 100k/night: $/1k and break-even."
    ),
    api_cached_share: float = typer.Option(
        0.0, "--api-cached-share", help="What-if: share of prompt tokens an API bills at its cached price (0-1)."
    ),
    billed_hours: float = typer.Option(
        0.0,
        "--billed-hours-per-night",
        help="What-if: GPU-hours each GPU is paid per night at least (24: reserved; 0: by the second, the default).",
    ),
    html: Optional[Path] = typer.Option(
        None, "--html", help="What-if: also write the projection and break-even chart as an HTML page here."
    ),
) -> None:
    """Pre-flight estimate: records, duplicates, share per tier, tokens and dollars, before any GPU work. With
    --hardware, also the projection of the same job on other GPUs, models and levers, beside batch APIs' prices."""
    from pipeline.generate.engine_api import EngineStartError
    from pipeline.job.progress import Progress
    from pipeline.plan.estimate import budget_problems
    from pipeline.stores.storage import StorageError

    cfg = load(config, input__uri=input)
    what_if = {
        "tiers": tier or [],
        "price": price_per_gpu_hour,
        "prices": api_prices,
        "volume": volume,
        "cached": api_cached_share,
        "billed": billed_hours,
    }
    if not hardware and (tier or price_per_gpu_hour is not None or api_prices or volume or html):
        fail("--tier, --price-per-gpu-hour, --api-prices, --volume and --html are what-if options: give --hardware too")
    # A what-if plans with the named models' tokenizers where there are no model files (plan/tokens.py).
    pool = _what_if_pool(cfg, what_if["tiers"]) if hardware else None
    try:
        # (a bar draws on stdout: with --format json, log lines on stderr keep stdout the JSON alone)
        progress = Progress("log" if format == "json" else cfg.run.progress, cfg.run.log_every_seconds)
        try:
            est = estimate_job(cfg, pool=pool, report=progress.planning)
        finally:
            progress.finish()
    except (StorageError, EngineStartError) as e:
        fail(str(e))
    est["budget_problems"] = budget_problems(cfg, est["est_usd"], est["tenants"]) if cfg.budget.active else []
    if hardware:
        est["token_counts"] = pool.sources
        est.update(_what_if(cfg, est, hardware, what_if))
    if html:
        from pipeline.plan.whatif_page import write_page

        write_page(html, cfg, est)
    if format == "json":
        typer.echo(json.dumps(est, indent=2))
        return
    console.print(_estimate_table(cfg, est))
    console.print(est["note"])
    if "projection" in est:
        console.print(_projection_table(est["projection"]))
    if "break_even" in est:
        console.print(_break_even_table(est["break_even"]))
        for figure, source in est["break_even"]["sources"].items():
            console.print(f"  {figure}: {source}", highlight=False)


def _what_if_pool(cfg, tiers: list[str]):
    """Planning's pool for a what-if: each --tier's named model's tokenizer where it has one here."""
    from pipeline.plan.tokens import WhatIfPool

    named = {}
    for t in tiers:
        name, _, rest = t.partition("=")
        named[name.strip()] = rest.split(":")[0]
    return WhatIfPool(cfg.tiers, named)


def _what_if(cfg, est: dict, hardware: str, what_if: dict) -> dict:
    from pipeline.plan import breakeven, whatif

    try:
        name, gpus = whatif.parse_hardware(hardware)
        specs = dict(whatif.parse_tier(t) for t in what_if["tiers"])
        unknown = set(specs) - set(cfg.tiers)
        if unknown:
            raise ValueError(f"--tier names no tier of this config: {', '.join(sorted(unknown))}")
        cached, billed = what_if["cached"], what_if["billed"]
        if not 0.0 <= cached <= 1.0:
            raise ValueError(f"--api-cached-share {cached}: a share, between 0 and 1")
        if not 0.0 <= billed <= 24.0:
            raise ValueError(f"--billed-hours-per-night {billed}: hours of a night, between 0 and 24")
        table, date = whatif.load_prices(what_if["prices"])
        price = what_if["price"]
        prices = price if price is not None else {n: t.price_per_gpu_hour for n, t in cfg.tiers.items()}
        out = whatif.project_job(est, cfg, name, gpus, specs, prices, table, date)
        if what_if["volume"]:
            volume = breakeven.parse_volume(what_if["volume"])
            measured = breakeven.measured_utilisation(cfg, cfg.output.uri)
            out["break_even"] = whatif.break_even(
                est, cfg, out["projection"], specs, volume, (table, date), measured, cached, billed
            )
        return out
    except (ValueError, OSError) as e:
        fail(str(e))


UNIT_STATUSES = ("pending", "leased", "done", "deferred")


def tier_workers(state) -> list[dict]:
    """Tier workers holding an engine now (their session's lease not run out), with their time so far."""
    from pipeline.stores.catalog import aware
    from pipeline.stores.units import UnitQueue

    t = state.db_now()
    out = []
    for s in sorted(UnitQueue(state).live_sessions(), key=lambda s: (s.job_id, s.tier, s.worker)):
        held = s.held_seconds
        out.append(
            {
                "job_id": s.job_id,
                "tier": s.tier,
                "worker": s.worker,
                "session_id": s.session_id,
                "gpus": s.gpus,
                "started_engine": bool(s.started),
                "held_seconds": round(held, 3),
                "startup_seconds": round(s.startup_seconds, 3),
                "busy_seconds": round(s.busy_seconds, 3),
                "idle_seconds": round(s.idle_seconds, 3),
                "utilisation": round(s.busy_seconds / held, 4) if held else None,
                "renewed_seconds_ago": round(max(0.0, (t - aware(s.heartbeat_at)).total_seconds()), 1),
            }
        )
    return out


def queue_depth(state, job_id: str) -> dict[str, dict[str, int]]:
    """Per tier: work units and their requests by status (`UnitQueue.depth`)."""
    from pipeline.stores.units import UnitQueue

    return dict(sorted(UnitQueue(state).depth(job_id).items()))


def workers_table(workers: list[dict]) -> Table:
    table = Table(title="tier workers (live engine sessions)")
    for col in ("job", "tier", "worker", "GPUs", "held s", "start-up s", "busy s", "idle s", "utilisation", "renewed"):
        table.add_column(col)
    for w in workers:
        util = w["utilisation"]
        table.add_row(
            w["job_id"],
            w["tier"],
            w["worker"],
            str(w["gpus"]),
            f"{w['held_seconds']:.1f}",
            f"{w['startup_seconds']:.1f}" + ("" if w["started_engine"] else " (reused)"),
            f"{w['busy_seconds']:.1f}",
            f"{w['idle_seconds']:.1f}",
            "-" if util is None else f"{util:.0%}",
            f"{w['renewed_seconds_ago']:.0f} s ago",
        )
    return table


def depth_table(job_id: str, depth: dict[str, dict[str, int]]) -> Table:
    table = Table(title=f"work units of job {job_id}: units (requests)")
    table.add_column("tier")
    for status in UNIT_STATUSES:
        table.add_column(status)
    for tier, d in depth.items():
        table.add_row(
            tier,
            *(f"{d[status]} ({d.get(f'{status}_requests', 0)})" if d.get(status) else "-" for status in UNIT_STATUSES),
        )
    return table


@app.command("status")
def status(
    config: Path = ConfigOption,
    job_id: str = typer.Option(..., "--job-id"),
    format: str = typer.Option("table", "--format", help="table or json"),
) -> None:
    """A job's partitions (status, attempts, worker, last error, counts), its work units per tier, and the tier
    workers holding an engine now (start-up, busy and idle seconds so far)."""
    cfg = load(config)
    state = state_store(cfg)
    job = state.job(job_id)
    if job is None:
        fail(f"no job {job_id}")
    parts = state.partitions(job_id)
    depth, workers = queue_depth(state, job_id), tier_workers(state)
    if format == "json":
        typer.echo(
            json.dumps(
                {
                    "job_id": job.job_id,
                    "status": job.status,
                    "error": job.error,
                    "partitions": [
                        {
                            "partition": p.partition,
                            "file": p.file,
                            "records": p.records,
                            "status": p.status,
                            "attempts": p.attempts,
                            "worker": p.worker,
                            "last_error": p.last_error,
                            "started_at": when(p.started_at),
                            "finished_at": when(p.finished_at),
                            "counts": counts.as_json() if (counts := PartitionCounts.parse(p.counts)) else None,
                        }
                        for p in parts
                    ],
                    "work_units": depth,
                    "tier_workers": workers,
                },
                indent=2,
            )
        )
        return
    table = Table(title=f"job {job.job_id}: {job.status}" + (f" ({job.error})" if job.error else ""))
    for col in (
        "partition",
        "file",
        "records",
        "status",
        "attempts",
        "outputs",
        "quarantined",
        "cost $",
        "worker",
        "last error",
    ):
        table.add_column(col)
    for p in parts:
        counts = PartitionCounts.parse(p.counts)
        table.add_row(
            p.partition,
            p.file,
            str(p.records),
            p.status,
            str(p.attempts),
            str(counts.outputs) if counts else "-",
            str(counts.quarantined) if counts else "-",
            f"{counts.cost_usd:.6f}" if counts else "-",
            p.worker or "-",
            (p.last_error or "")[:80],
        )
    console.print(table)
    console.print(depth_table(job.job_id, depth) if depth else f"job {job.job_id}: no work units in the catalog")
    console.print(workers_table(workers) if workers else "no tier worker holds an engine now")


@jobs_app.command("list")
def jobs_list(
    config: Path = ConfigOption, format: str = typer.Option("table", "--format", help="table or json")
) -> None:
    """Every job in the state catalog, newest first."""
    jobs = state_store(load(config)).jobs()
    rows = [
        {
            "job_id": j.job_id,
            "status": j.status,
            "created_at": when(j.created_at),
            "finished_at": when(j.finished_at),
            "records": JobCounts.parse(j.counts).records if j.counts else None,
            "output_uri": redact_url(j.output_uri),
            "error": j.error,
        }
        for j in jobs
    ]
    if format == "json":
        typer.echo(json.dumps(rows, indent=2))
        return
    table = Table()
    for col in ("job_id", "status", "created_at", "finished_at", "records", "output_uri", "error"):
        table.add_column(col)
    for r in rows:
        table.add_row(*(str(r[k]) if r[k] is not None else "-" for k in r))
    console.print(table)
