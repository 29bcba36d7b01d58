"""The `tokenmill` command's wiring: every verb registered, `estimate`, and its old name `plan` refused."""

import json

import typer
from typer.testing import CliRunner

from pipeline.cli import app
from tests.conftest import ONE_TIER, TINY_CONFIG


def test_every_verb_is_registered_and_the_old_name_plan_is_hidden():
    group = typer.main.get_command(app)
    assert {"run", "rerun", "estimate", "plan", "status", "report", "samples",
            "jobs", "ledger", "router", "models", "config", "cache"} <= set(group.commands)
    assert group.commands["plan"].hidden and not group.commands["estimate"].hidden
    listed = CliRunner().invoke(app, ["--help"]).output
    assert "estimate" in listed and "Pre-flight estimate" in listed and not any(
        line.split()[1:2] == ["plan"] for line in listed.splitlines() if line.strip())  # hidden from help


def test_estimate_counts_every_record_and_the_old_name_plan_is_refused(tiny_models, sample_corpus, tmp_path,
                                                                      monkeypatch):
    for key, value in {**ONE_TIER, "TOKENMILL_OUTPUT__URI": str(tmp_path / "output")}.items():
        monkeypatch.setenv(key, value)
    args = ["--config", str(TINY_CONFIG), "--input", str(sample_corpus[0]), "--format", "json"]
    runner = CliRunner()
    estimate, plan = runner.invoke(app, ["estimate", *args]), runner.invoke(app, ["plan", *args])
    assert estimate.exit_code == 0, estimate.output
    assert json.loads(estimate.stdout)["records"] == sample_corpus[1]["documents"] + sample_corpus[1]["bad_records"]
    assert plan.exit_code == 2 and not plan.stdout
    assert plan.stderr.strip() == "error: `tokenmill plan` is now `tokenmill estimate` (the same options and output)"
