"""The learned router: train it on labels, calibrate its threshold, write a synthetic labelled set."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from pipeline.cli.common import console, fail, load, router_app


def _router_tiers(cfg) -> tuple[str, str]:
    """(small, large): the cheapest tier and the largest (baseline) tier of the config."""
    prices = cfg.tier_prices
    small = min(prices, key=prices.get)
    if small == cfg.largest_tier:
        fail("the router needs two tiers of different price in the config")
    return small, cfg.largest_tier


def _cost_per_item(cfg, tier: str, texts: list[str]) -> float:
    """Rough USD per item on a tier: the pre-flight estimate (plan/estimate.py) of a prompt of the labels'
    mean length (≈ chars/4 tokens) at the tier's configured default rate."""
    import pyarrow as pa

    from pipeline.plan.estimate import estimate_usd
    from pipeline.plan.rates import tier_rates

    prompt = sum(len(x) for x in texts) / max(len(texts), 1) / 4
    return estimate_usd(pa.array([tier]), pa.array([prompt]), cfg, tier_rates(cfg))[0]


@router_app.command("train")
def router_train(
    config: Path = typer.Option(..., "--config", help="Config whose tiers the router chooses between."),
    labels: Path = typer.Option(..., "--labels", help="Labelled JSONL (see docs/data-engineer.md)."),
    out: Optional[Path] = typer.Option(
        None, "--out", help="Artifact path (default: route.router from the config, else ./router.json)."
    ),
    target_quality: float = typer.Option(
        0.95,
        "--target-quality",
        help="An item's small-tier output 'suffices' at this share of the large tier's quality.",
    ),
) -> None:
    """Fit the router on labelled items and write a versioned artifact (then run `router eval` to calibrate it)."""
    from pipeline.route.router import RouterError, read_labels, train

    cfg = load(config)
    small, large = _router_tiers(cfg)
    try:
        artifact = train(read_labels(labels, small, large), small, large, target_quality)
    except RouterError as e:
        fail(str(e))
    target = out or Path(cfg.route.router or "router.json")
    target.write_text(json.dumps(artifact, indent=2))
    typer.echo(
        f"router {artifact['version']} trained on {artifact['trained_on']} items "
        f"({artifact['small_suffices_share']:.0%} fine on {small}; sigmoid-calibrated over "
        f"{artifact['calibration']['folds']} folds) -> {target}"
    )


def _eval_table(router, data, rows: list[dict], best: dict | None, large: str) -> Table:
    table = Table(title=f"router {router.artifact['version']} on {len(data.texts)} labelled items")
    for col in ("threshold", f"to {large}", "cost/item", "quality kept"):
        table.add_column(col, justify="right")
    for r in rows:
        mark = " <" if best and r["threshold"] == best["threshold"] else ""
        table.add_row(
            f"{r['threshold']:.2f}{mark}",
            f"{r['large_share']:.1%}",
            f"${r['cost_per_item_usd']:.8f}",
            f"{r['quality_kept']:.1%}",
        )
    return table


def calibration_table(curve: list[dict], small: str) -> Table:
    """The router's calibration: predicted P(small suffices) per bin against what was observed."""
    table = Table(title=f"calibration: predicted p against the observed share where {small} suffices")
    for col in ("p bin", "mean predicted", "observed", "items"):
        table.add_column(col, justify="right")
    for r in curve:
        table.add_row(
            f"{r['low']:.1f}-{r['high']:.1f}", f"{r['mean_predicted']:.3f}", f"{r['observed']:.3f}", str(r["count"])
        )
    return table


@router_app.command("eval")
def router_eval(
    config: Path = typer.Option(..., "--config"),
    labels: Path = typer.Option(..., "--labels", help="Labelled JSONL, ideally not the training set."),
    artifact: Optional[Path] = typer.Option(None, "--router", help="Artifact (default: route.router from the config)."),
    target_quality: float = typer.Option(
        0.95, "--target-quality", help="Quality to keep, relative to sending everything to the large tier."
    ),
    fmt: str = typer.Option("table", "--format", help="table or json"),
) -> None:
    """Per threshold: share sent to the large tier, cost per item, quality kept; then the calibration curve; writes
    the cheapest threshold meeting the target."""
    from pipeline.route.router import Router, RouterError, calibration_curve, evaluate, pick_threshold, read_labels

    cfg = load(config)
    small, large = _router_tiers(cfg)
    path = artifact or (Path(cfg.route.router) if cfg.route.router else None)
    if path is None:
        fail("no router artifact: pass --router or set route.router")
    try:
        router, data = Router.load(path), read_labels(labels, small, large)
    except RouterError as e:
        fail(str(e))
    rows = evaluate(router, data, _cost_per_item(cfg, small, data.texts), _cost_per_item(cfg, large, data.texts))
    best = pick_threshold(rows, target_quality)
    curve = calibration_curve(router, data, target_quality)
    if best is not None:
        router.artifact.update(
            threshold=best["threshold"],
            calibrated_quality=best["quality_kept"],
            calibrated_target=target_quality,
            calibrated_on=len(data.texts),
        )
        path.write_text(json.dumps(router.artifact, indent=2))
    if fmt == "json":
        typer.echo(
            json.dumps({"rows": rows, "chosen": best, "target_quality": target_quality, "calibration": curve}, indent=2)
        )
    else:
        console.print(_eval_table(router, data, rows, best, large))
        console.print(calibration_table(curve, small))
    if best is None:
        fail(f"no threshold keeps {target_quality:.0%} of all-{large} quality; the artifact keeps its threshold")
    typer.echo(
        f"threshold {best['threshold']:.2f} written to {path}: {best['large_share']:.1%} to {large}, "
        f"quality kept {best['quality_kept']:.1%}"
    )


@router_app.command("example-labels")
def router_example_labels(
    path: Path = typer.Argument(..., help="Where to write the JSONL."),
    items: int = typer.Option(400, help="Number of labelled items."),
) -> None:
    """Write a clearly SYNTHETIC labelled set (the format, and something to try train/eval on)."""
    from pipeline.dev.labels import example_labels

    example_labels(path, items)
    typer.echo(f"wrote {items} synthetic labelled items to {path}")
