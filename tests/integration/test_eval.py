"""`tokenmill eval`'s quality figures on the fake engine: each output check's rate per tier with its 95%
interval, the share acceptable and its price, and the sampling knobs against loops measured against none.
(tests/engine/test_real_model.py runs the same eval on the real model.)"""

from __future__ import annotations

import io

import pytest


@pytest.fixture
def holdout(tmp_path):
    from pipeline.dev.holdout import build_holdout

    path = tmp_path / "holdout.jsonl"
    build_holdout(path, documents=12, variants=4, seed=3)
    return path


def test_eval_reports_each_check_per_tier_and_the_loop_knobs_against_none(make_config, tiny_models, holdout):
    from pipeline.evals.evaluate import run_eval

    config = make_config(routing=True, sampling__frequency_penalty=0.5)
    result = run_eval(config, holdout, min_documents=3)
    for tier, section in result["tiers"].items():
        n = section["documents"]  # answered on the tier and the baseline (the tiny models' context is short)
        assert n >= 3 and n + section["failed"] >= 12, (tier, section)
        for measured in (*section["checks"].values(), section["acceptable"]):
            low, high = measured["ci95"]
            assert 0.0 <= low <= measured["rate"] <= high <= 1.0, (tier, section)
        kept = round(section["acceptable"]["rate"] * n)
        if kept:  # all spent, per summary kept: never less than per document
            assert section["cost_per_1k_acceptable_usd"] == pytest.approx(
                section["cost_per_1k_usd"] * n / kept, rel=1e-3
            )
    knobs = result["loop_knobs"]
    assert knobs["tier"] == "small" and knobs["knobs"] == {"frequency_penalty": 0.5}
    assert knobs["with"]["documents"] == knobs["without"]["documents"] == result["tiers"]["small"]["documents"]
    # As configured is the tier's own run; knobs neutral is another: the fake engine's outputs are a function
    # of the sampling parameters, so the two agree with the baseline differently.
    assert knobs["with"]["acceptable"] == result["tiers"]["small"]["acceptable"]
    assert knobs["with"]["rouge_l_vs_baseline"] != knobs["without"]["rouge_l_vs_baseline"]
    assert run_eval(make_config(routing=True), holdout, min_documents=3)["loop_knobs"] is None  # none set: none run
    # The tables `tokenmill eval` prints, 100 columns wide as off a terminal.
    from rich.console import Console

    from pipeline.cli.evals import checks_table, knobs_table

    console = Console(width=100, record=True, file=io.StringIO())
    console.print(checks_table(result), knobs_table(knobs))
    shown = console.export_text()
    assert "off topic" in shown and "$/1k acceptable" in shown and "frequency_penalty=0.5" in shown
    assert "as configured" in shown and "knobs neutral" in shown
    assert all(len(line) <= 100 for line in shown.splitlines())


def test_an_eval_output_is_flagged_as_the_job_flags_it(make_config):
    from pipeline.evals.runs import TierRun
    from pipeline.generate.quality import measure

    config = make_config()
    doc = "The quarterly report covers revenue growth in the northern region and the hiring of engineers."
    outputs = {
        "loop": "growth growth growth " * 30,
        "copy": doc,
        # five of the document's topic words: fewer would be `vague` (checks.vague_below)
        "good": "The quarterly report: revenue grew in the northern region, and engineers were hired.",
        "cut": "Revenue grew in the northern region and",
    }
    run = TierRun(
        tier="small",
        summary=outputs,
        finish_reason={**dict.fromkeys(outputs, "stop"), "cut": "length"},
        mean_logprob=dict.fromkeys(outputs, -0.5),
        output_tokens=dict.fromkeys(outputs, 10),
        usd=dict.fromkeys(outputs, 0.001),
        measures={i: measure(s, doc) for i, s in outputs.items()},
        engine_seconds=1.0,
        failed={},
    )
    assert {i: run.flags(i, config.checks) for i in outputs} == {
        "loop": ["degenerate", "vague"],
        "copy": ["copied"],
        "good": [],
        "cut": ["vague", "truncated"],
    }
    assert [i for i in outputs if run.acceptable(i, run.flags(i, config.checks))] == ["good"]


def test_no_acceptable_output_on_all_large_leaves_all_large_chosen(make_config, tiny_models, holdout):
    """Where all-large made no acceptable output, every policy keeps "all" of its none: the eval has no evidence
    that a cheaper one is as good, so all-large stays (the config is not moved to the small tier)."""
    from pipeline.evals.evaluate import run_eval

    result = run_eval(make_config(routing=True, checks__vague_below=10_000), holdout, min_documents=3)
    assert result["tiers"]["large"]["acceptable"]["rate"] == 0.0
    assert result["routing"]["chosen"]["all_large"] is True
