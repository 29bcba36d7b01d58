"""The LLM judge (`checks.judge`) once on the real engine: SmolLM2-135M-Instruct in float32 (the demo's large
tier, as `tokenmill models real` builds it) judges four labelled outputs, and `calibrate` sets its verdicts beside
the labels. A 135M model is no judge worth trusting: this checks the path (prompt, context, answer, verdict),
not its agreement, which `tokenmill checks calibrate --judge` measures for a deployment's own strong model."""

from __future__ import annotations

import json

import pytest

from tests.conftest import REPO
from tests.engine.test_real_model import real_config, real_models  # noqa: F401 (a fixture)

pytestmark = pytest.mark.real_model


def test_the_judge_answers_on_the_real_engine_and_calibrate_reports_its_agreement(real_models, tmp_path):  # noqa: F811
    from pipeline.evals.calibrate import calibrate
    from pipeline.evals.llm_judge import run_judge
    from pipeline.generate.engine import shutdown_engines

    labels = [
        json.loads(line) for line in (REPO / "tests" / "data" / "judge" / "labels.jsonl").read_text().splitlines()
    ]
    rows = [
        next(r for r in labels if r["verdict"] == v and r["split"] == s)
        for v in ("good", "bad")
        for s in ("calibration", "test")
    ]
    config = real_config(tmp_path, TOKENMILL_CHECKS__JUDGE=json.dumps({"tier": "large"}))
    try:
        judged = run_judge(config, rows)
    finally:
        shutdown_engines()
    assert len(judged) == 4 and all(j["answer"].strip() for j in judged), judged  # it answered every one
    assert all(j["verdict"] in (True, False, None) for j in judged)
    result = calibrate([{**r, "judge": j["verdict"]} for r, j in zip(rows, judged)], config.checks)
    for half in ("calibration", "test"):
        judge = result["after"][half]["judge"]
        assert judge["recall"]["n"] == 1 and judge["tp"] + judge["fp"] == sum(
            j["verdict"] is True for r, j in zip(rows, judged) if r["split"] == half
        )
