"""`tokenmill checks score` and `checks calibrate`: the output checks on your own outputs and labels."""

from __future__ import annotations

import json
from datetime import date
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from pipeline.cli.common import checks_app, console, fail, load
from pipeline.config import ChecksConfig

ConfigChoice = typer.Option(None, "--config", "-c", help="YAML config whose `checks` apply (default: the defaults).")


def _checks(config: Path | None) -> ChecksConfig:
    return load(config).checks if config else ChecksConfig()


@checks_app.command("score")
def score(
    input: Path = typer.Option(..., "--input", help="JSONL: `document`, `summary`, optional `finish_reason`."),
    config: Optional[Path] = ConfigChoice,
) -> None:
    """One JSON line per input line: every measure, every flag and `acceptable`, as the tier worker and the
    ledger compute them."""
    from pipeline.evals.calibrate import LabelsError, read_lines, scored

    checks = _checks(config)
    try:
        rows = read_lines(input, ("document", "summary"))
    except LabelsError as e:
        fail(str(e))
    for row in rows:
        typer.echo(json.dumps(scored(row["document"], row["summary"], row.get("finish_reason", "stop"), checks)))


def _share(s: dict) -> str:
    if s["rate"] is None:
        return f"- (n={s['n']})"
    return f"{s['rate']:.2f} ({s['ci95'][0]:.2f}-{s['ci95'][1]:.2f}, n={s['n']})"


def agreement_table(title: str, rows: dict) -> Table:
    t = Table(title=title)
    for col in ("flag", "precision (95% CI)", "recall (95% CI)"):
        t.add_column(col, justify="right")
    for flag, a in rows.items():
        t.add_row(flag, _share(a["precision"]), _share(a["recall"]))
    return t


def _judged(config: Path | None, rows: list[dict]) -> list[dict]:
    """`rows` with the config's LLM judge's verdict each (`judge`: true keep, false bad, null none)."""
    from pipeline.evals.llm_judge import run_judge
    from pipeline.generate.engine import shutdown_engines
    from pipeline.generate.engine_api import EngineStartError

    cfg = load(config) if config else None
    if cfg is None or cfg.checks.judge is None:
        fail("--judge needs --config with checks.judge (a tier and a rubric)")
    try:
        answers = run_judge(cfg, rows)
    except EngineStartError as e:
        fail(str(e))
    finally:
        shutdown_engines()
    return [{**r, "judge": a["verdict"]} for r, a in zip(rows, answers)]


@checks_app.command("calibrate")
def calibrate_cmd(
    labels: Path = typer.Option(
        ..., "--labels", help="JSONL: document, summary, verdict, tags (docs/judge-rubric.md)."
    ),
    config: Optional[Path] = ConfigChoice,
    target_precision: float = typer.Option(
        0.9,
        "--target-precision",
        min=0.0,
        max=1.0,
        help="Each check's precision to reach (degenerate, copied, off_topic).",
    ),
    acceptable_recall: float = typer.Option(
        0.6,
        "--acceptable-recall",
        min=0.0,
        max=1.0,
        help="`acceptable`'s recall floor (unfaithful, vague: its precision).",
    ),
    update_config: bool = typer.Option(False, "--update-config", help="Write the chosen thresholds into --config."),
    judge: bool = typer.Option(
        False,
        "--judge",
        help="Also run the config's LLM judge (checks.judge) on every labelled output and report its agreement.",
    ),
    fmt: str = typer.Option("table", "--format", help="table or json"),
) -> None:
    """Choose each check's thresholds on the labels' calibration half; report precision and recall on the test half."""
    from pipeline.evals.apply import ApplyError, apply_values
    from pipeline.evals.calibrate import LabelsError, calibrate, read_labels

    if update_config and config is None:
        fail("--update-config needs --config: the file to write the thresholds into")
    try:
        rows = read_labels(labels)
    except LabelsError as e:
        fail(str(e))
    if judge:
        rows = _judged(config, rows)
    result = calibrate(rows, _checks(config), target_precision, acceptable_recall)
    if fmt == "json":
        typer.echo(json.dumps(result))
    else:
        console.print(agreement_table("test half, thresholds now", result["before"]["test"]))
        console.print(agreement_table("test half, thresholds chosen on the calibration half", result["after"]["test"]))
        typer.echo(f"chosen: {json.dumps(result['thresholds'])}")
    if update_config:
        values = {("checks", k): v for k, v in result["thresholds"].items()}
        try:
            config.write_text(apply_values(config.read_text(), values, f"tokenmill checks calibrate {date.today()}"))
        except ApplyError as e:
            fail(str(e))
        typer.echo(f"wrote the chosen thresholds into {config}", err=fmt == "json")
