"""The `tokenmill` command's wiring: every verb registered, `estimate` and its deprecated alias `plan`."""

import json

import typer
from typer.testing import CliRunner

from pipeline.cli import app
from tests.conftest import ONE_TIER, TINY_CONFIG


def test_every_verb_is_registered_and_plan_is_a_hidden_alias():
    group = typer.main.get_command(app)
    assert {"run", "rerun", "estimate", "plan", "status", "report", "samples",
            "jobs", "ledger", "router", "models", "config", "cache"} <= set(group.commands)
    assert group.commands["plan"].hidden and not group.commands["estimate"].hidden
    listed = CliRunner().invoke(app, ["--help"]).output
    assert "estimate" in listed and "Pre-flight estimate" in listed and not any(
        line.split()[1:2] == ["plan"] for line in listed.splitlines() if line.strip())  # hidden from help


def test_plan_warns_then_prints_the_same_estimate(tiny_models, sample_corpus, tmp_path, monkeypatch):
    for key, value in {**ONE_TIER, "TOKENMILL_OUTPUT__URI": str(tmp_path / "output")}.items():
        monkeypatch.setenv(key, value)
    args = ["--config", str(TINY_CONFIG), "--input", str(sample_corpus[0]), "--format", "json"]
    runner = CliRunner()
    estimate, plan = runner.invoke(app, ["estimate", *args]), runner.invoke(app, ["plan", *args])
    assert estimate.exit_code == 0 and plan.exit_code == 0, plan.output
    assert "deprecated" not in estimate.stderr
    assert plan.stderr.splitlines()[0] == ("note: `tokenmill plan` is deprecated, use `tokenmill estimate` "
                                           "(same options and output)")
    assert json.loads(plan.stdout) == json.loads(estimate.stdout)
    assert json.loads(estimate.stdout)["records"] == sample_corpus[1]["documents"] + sample_corpus[1]["bad_records"]
