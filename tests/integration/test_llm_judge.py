"""The LLM judge (`checks.judge`, pipeline/evals/llm_judge.py) on the fake engine, its answers scripted: its
verdicts read from its answers and set beside a reader's labels by `calibrate` like any other check's flags."""

import pytest

from pipeline.evals.calibrate import calibrate
from pipeline.evals.llm_judge import run_judge
from pipeline.generate.judge import judge_messages, verdict
from tests.unit.test_checks_judge import LABELS, share


@pytest.mark.parametrize(
    "answer, read",
    [("KEEP", True), (" keep.", True), ("Good", True), ("BAD", False), ("No, it loops", False), ("Maybe", None)],
)
def test_the_judges_first_word_is_its_verdict(answer, read):
    assert verdict(answer) is read


def test_a_documents_braces_are_text_in_the_rubric():
    (message,) = judge_messages("D: {document} S: {summary}", "a {summary} b", "s")
    assert message["content"] == "D: a {summary} b S: s"


def test_the_judges_agreement_with_the_labels_is_measured_like_a_checks(make_config):
    # Scripted: the judge keeps the good test item and the Larry Wall one, calls the loop and the prompt echo
    # bad, and gives no verdict on the refund (counted as not kept).
    answers = {
        "copyright notice is kept.\n": "KEEP",
        "Modified versions must be renamed. Modified": "BAD",
        "promises buyers a refund": "I am not sure",
        "Summarize the following document": "BAD",
        "by Larry Wall": "KEEP it",
        "": "KEEP",  # every other output (the calibration half)
    }
    config = make_config(checks__judge={"tier": "large"}, tiers__large__fake__answers=answers)
    judged = run_judge(config, LABELS)
    assert [j["verdict"] for j in judged[3:]] == [True, False, None, False, True]
    rows = [{**r, "judge": j["verdict"]} for r, j in zip(LABELS, judged)]
    test = calibrate(rows, config.checks, target_precision=0.9)["after"]["test"]
    # Kept by the reader: items 1 (good) and 5 (borderline), both kept by the judge; nothing else kept.
    assert test["judge"]["precision"] == share(2, 2) and test["judge"]["recall"] == share(2, 2)
    assert test["judge"]["no_verdict"] == 1


def test_a_judge_on_an_unknown_tier_is_refused(make_config):
    with pytest.raises(ValueError, match="checks.judge.tier 'huge' is not one of tiers"):
        make_config(checks__judge={"tier": "huge"})


def test_calibrate_with_judge_needs_a_config_that_names_one(tmp_path):
    import json

    from typer.testing import CliRunner

    from pipeline.cli import app

    path = tmp_path / "labels.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in LABELS))
    result = CliRunner().invoke(app, ["checks", "calibrate", "--labels", str(path), "--judge"])
    assert result.exit_code == 2 and "--judge needs --config with checks.judge" in result.output
