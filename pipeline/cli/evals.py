"""`tokenmill eval`: the quality of every saving on a hold-out set, next to its cost; writes what it chose."""

from __future__ import annotations

import json
from datetime import date
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from pipeline.cli.common import ConfigOption, app, console, fail, load
from pipeline.cli.router import calibration_table
from pipeline.config import tokenmill_home


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def _num(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def tiers_table(result: dict) -> Table:
    t = Table(title=f"tiers against {result['baseline_tier']} on {result['holdout']['documents']} hold-out documents")
    for col in ("tier", "ROUGE-L", "identical", "unfaithful (95% CI)", "truncated", "out tokens", "$/1k docs"):
        t.add_column(col, justify="right")
    for name, s in result["tiers"].items():
        ci = s["unfaithful_ci95"]
        t.add_row(
            name,
            _num(s["rouge_l_vs_baseline"], ".3f"),
            _pct(s["identical_share"]),
            f"{_pct(s['unfaithful_rate'])} ({ci[0]:.1%}-{ci[1]:.1%})",
            _pct(s["truncated_share"]),
            _num(s["mean_output_tokens"], ".1f"),
            f"${s['cost_per_1k_usd']:.5f}",
        )
    return t


def checks_table(result: dict) -> Table:
    """Each tier's output checks on the hold-out set, with 95% intervals, and what a kept summary costs."""
    t = Table(title="output checks per tier: share of outputs flagged (95% CI); acceptable: none failed")
    for col in ("tier", "degenerate", "copied", "off topic", "acceptable", "$/1k acceptable"):
        t.add_column(col, justify="right")
    for name, s in result["tiers"].items():
        t.add_row(
            name,
            *(_rate(s["checks"][c]) for c in ("degenerate", "copied", "off_topic")),
            _rate(s["acceptable"]),
            _num(s["cost_per_1k_acceptable_usd"], ".5f"),
        )
    return t


def knobs_table(knobs: dict) -> Table:
    """The sampling knobs against loops: the cheaper tier with and without them."""
    set_ = ", ".join(f"{k}={v}" for k, v in knobs["knobs"].items())
    t = Table(title=f"sampling knobs against loops on {knobs['tier']} ({set_}) against none")
    for col in ("sampling", "degenerate", "acceptable", "ROUGE-L"):
        t.add_column(col, justify="right")
    for name in ("with", "without"):
        s = knobs[name]
        t.add_row(
            "as configured" if name == "with" else "knobs neutral",
            _rate(s["degenerate"]),
            _rate(s["acceptable"]),
            _num(s["rouge_l_vs_baseline"], ".3f"),
        )
    return t


def _rate(r: dict) -> str:
    return "-" if r["rate"] is None else f"{r['rate']:.1%} ({r['ci95'][0]:.1%}-{r['ci95'][1]:.1%})"


def policy_table(title: str, rows: list[dict], chosen: dict | None) -> Table:
    t = Table(title=title)
    for col in (
        "router <",
        "min logprob",
        "trunc",
        "unfaithful",
        "acceptable (95% CI)",
        "quality kept",
        "ROUGE-L kept",
        "kept small",
        "escalated",
        "$/1k docs",
    ):
        t.add_column(col, justify="right")
    for r in rows:
        mark = " <" if r == chosen else ""
        t.add_row(
            "all" if r.get("all_large") else "-" if r["router_threshold"] is None else f"{r['router_threshold']:.2f}",
            "off" if r["min_mean_logprob"] is None else f"{r['min_mean_logprob']:.3f}",
            "on" if r["on_truncation"] else "off",
            "on" if r["on_unfaithful"] else "off",
            _rate(r["acceptable"]),
            f"{r['quality_kept']:.1%}{mark}",
            f"{r['rouge_l_kept']:.3f}",
            _pct(r["small_share"]),
            _pct(r["escalated_share"]),
            f"${r['cost_per_1k_usd']:.5f}",
        )
    return t


def reuse_table(reuse: dict) -> Table:
    t = Table(
        title="near and semantic reuse: false hits (labelled must-not, or claims the new document lacks); "
        "agreement with shadow regenerations"
    )
    for col in ("kind", "reused", "false hits", "rate (95% CI)", "agreement"):
        t.add_column(col, justify="right")
    for kind, s in [*reuse["by_kind"].items(), ("all", reuse["total"])]:
        t.add_row(
            kind,
            str(s["reused"]),
            str(s["false_hits"]),
            f"{_pct(s['false_hit_rate'])} ({s['ci95'][0]:.1%}-{s['ci95'][1]:.1%})",
            "-" if s["mean_agreement"] is None else f"{s['mean_agreement']:.3f}",
        )
    return t


def write_outputs(result: dict, out: Path) -> Path | None:
    """eval.json, labels.jsonl (for `router train`) and router.candidate.json (the router this eval trained).
    The candidate never replaces router.json, which a config may be routing with: only --update-config does."""
    out.mkdir(parents=True, exist_ok=True)
    artifact = result["routing"].pop("router_artifact")
    router_path = None
    if artifact is not None:
        router_path = out / "router.candidate.json"
        router_path.write_text(json.dumps(artifact, indent=2))
    labels = result.pop("labels")
    (out / "labels.jsonl").write_text("".join(json.dumps(row) + "\n" for row in labels), encoding="utf-8")
    (out / "eval.json").write_text(json.dumps(result, indent=2))
    return router_path


def print_tables(result: dict, target_quality: float) -> None:
    """The eval's tables: tiers, checks, knobs, each policy family, calibration and reuse."""
    routing, chosen = result["routing"], result["routing"]["chosen"]
    console.print(tiers_table(result))
    console.print(checks_table(result))
    if result["loop_knobs"]:
        console.print(knobs_table(result["loop_knobs"]))
    console.print(policy_table("routing: router threshold alone", routing["by_router_threshold"], chosen))
    console.print(policy_table("escalation: confidence threshold, no router", routing["by_logprob_threshold"], chosen))
    console.print(policy_table("escalation signals alone", routing["signals_alone"], chosen))
    console.print(
        policy_table(
            f"chosen (cheapest keeping {target_quality:.0%}) next to all-small and all-large",
            [r for r in (chosen, routing["all_small"], routing["all_large"]) if r],
            chosen,
        )
    )
    if routing["calibration_curve"]:
        console.print(calibration_table(routing["calibration_curve"], next(iter(result["tiers"]))))
    if routing["note"]:
        typer.echo(routing["note"])
    console.print(reuse_table(result["reuse"]))


def write_chosen(config: Path, cfg, routing: dict, router_path: Path | None, baseline: str, quiet: bool) -> None:
    """Write the chosen thresholds (and the router, when the policy uses one) into the --config file, and the
    eval's figure as `route.decided_by`."""
    from pipeline.evals.apply import ApplyError, apply_values, chosen_values, decided_by

    chosen = routing["chosen"]

    live_router = None
    if router_path is not None and chosen["router_threshold"] is not None:
        live_router = router_path.with_name("router.json")
        live_router.write_text(router_path.read_text())
    small = min(cfg.tier_prices, key=cfg.tier_prices.get)
    values = chosen_values(chosen, small, baseline, str(live_router) if live_router else None)
    values[("route", "decided_by")] = decided_by(routing, small, baseline, str(date.today()))
    try:
        config.write_text(apply_values(config.read_text(), values, f"tokenmill eval {date.today()}"))
    except ApplyError as e:
        fail(str(e))
    typer.echo(f"wrote the chosen thresholds into {config}", err=quiet)


@app.command("eval")
def evaluate(
    config: Path = ConfigOption,
    holdout: Path = typer.Option(
        Path("data/holdout.jsonl"),
        "--holdout",
        help="Hold-out JSONL (`python benchmarks/eval_set.py` builds one from this machine's text).",
    ),
    target_quality: float = typer.Option(
        0.95,
        "--target-quality",
        help="Quality to keep: the share of outputs acceptable (no output check failed) relative to all-large's.",
    ),
    out: Optional[Path] = typer.Option(
        None, "--out", help="Folder for eval.json, labels.jsonl and router.json (default $TOKENMILL_HOME/eval)."
    ),
    update_config: bool = typer.Option(
        False, "--update-config", help="Write the chosen escalation thresholds and router into the --config file."
    ),
    min_documents: int = typer.Option(
        20, "--min-documents", help="Fewest documents in the test half to choose a policy from."
    ),
    fmt: str = typer.Option("table", "--format", help="table or json"),
) -> None:
    """Run the hold-out set on every tier; score routing, escalation, reuse and quantisation; pick the cheapest
    policy that keeps the target."""
    from pipeline.evals.evaluate import EvalError, run_eval
    from pipeline.generate.engine import shutdown_engines
    from pipeline.generate.engine_api import EngineStartError

    cfg = load(config)
    if not holdout.is_file():
        fail(f"hold-out set {holdout} not found (build one: python benchmarks/eval_set.py {holdout})")
    try:
        result = run_eval(cfg, holdout, target_quality, min_documents=min_documents)
    except (EvalError, EngineStartError) as e:
        fail(str(e))
    finally:
        shutdown_engines()
    router_path = write_outputs(result, out or tokenmill_home() / "eval")
    routing, chosen = result["routing"], result["routing"]["chosen"]
    if fmt == "json":
        typer.echo(json.dumps(result))
    else:
        print_tables(result, target_quality)
    if chosen is None:
        fail(f"no policy keeps {target_quality:.0%} of all-{result['baseline_tier']} quality; the config is unchanged")
    typer.echo(
        f"chosen: acceptable {_rate(chosen['acceptable'])}, quality kept {chosen['quality_kept']:.1%} of "
        f"all-large's, ROUGE-L kept {chosen['rouge_l_kept']:.3f}, {chosen['small_share']:.1%} kept on the small tier, "
        f"${chosen['cost_per_1k_usd']:.5f} per 1k documents (all-large ${routing['all_large']['cost_per_1k_usd']:.5f})",
        err=fmt == "json",
    )
    if update_config:
        write_chosen(config, cfg, routing, router_path, result["baseline_tier"], fmt == "json")
