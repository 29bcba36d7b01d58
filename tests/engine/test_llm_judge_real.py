"""The LLM judge (`checks.judge`) on the real engine: SmolLM2-135M-Instruct in float32 (the demo's large tier, as
`tokenmill models real` builds it) judges a job's outputs as a follow-up wave and four labelled outputs through
`run_judge`, one engine start for both. A 135M model is no judge worth trusting: this checks the path (prompt,
context, answer, verdict), not its agreement, which `tokenmill checks calibrate --judge` measures for a
deployment's own strong model."""

from __future__ import annotations

import json

import pytest

from tests.conftest import REPO, read_kind
from tests.engine.test_real_model import real_config, real_models  # noqa: F401 (a fixture)

pytestmark = pytest.mark.real_model


def test_a_jobs_judge_wave_asks_what_run_judge_asks_and_calibrate_sets_its_verdicts_beside_labels(
    real_models,  # noqa: F811
    tmp_path,
):
    """The judge in a job (a follow-up wave through the tier worker's streaming engine) asks what `run_judge` asks:
    each paid verdict's prompt is the one `run_judge` builds for that output (its tokens counted in the ledger),
    and the verdict is one of the judge's. (Not the same words from both: a batch's outputs need not be those of
    each request alone.) The summaries come from the fake engine on the small tier (scripted, so they pass the
    checks, and no escalation); the large tier, the judge, is the real model. Then `run_judge` on four labelled
    outputs (a good and a bad one of each half, the shortest: the path is what is checked, not the prefill), and
    `calibrate` counts its verdicts per half."""
    from pipeline import run_job
    from pipeline.evals.calibrate import calibrate
    from pipeline.evals.llm_judge import run_judge
    from pipeline.generate.engine import EnginePool, shutdown_engines
    from pipeline.generate.judge import VERDICTS, fitted_prompt

    doc = (
        "The Artistic License lets anyone copy and distribute the Standard Version of the Package, provided the "
        "copyright notice is kept. Modified versions must be clearly documented and renamed."
    )
    good = "The Artistic License lets anyone copy the Standard Version; modified versions must be renamed."
    (tmp_path / "input").mkdir()
    docs = [{"id": w, "text": f"Notice {w}. {doc}"} for w in ("alpha", "bravo")]
    (tmp_path / "input" / "a.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    labels = [
        json.loads(line) for line in (REPO / "tests" / "data" / "judge" / "labels.jsonl").read_text().splitlines()
    ]
    rows = [
        min((r for r in labels if r["verdict"] == v and r["split"] == s), key=lambda r: len(r["document"]))
        for v in ("good", "bad")
        for s in ("calibration", "test")
    ]
    config = real_config(
        tmp_path,
        TOKENMILL_CHECKS__JUDGE=json.dumps({"tier": "large"}),
        TOKENMILL_TIERS__SMALL__ENGINE="fake",
        TOKENMILL_TIERS__SMALL__FAKE__ANSWERS=json.dumps({"Notice ": good}),
        TOKENMILL_ROUTE__DEFAULT_TIER="small",
        TOKENMILL_ROUTE__RULES="[]",
        TOKENMILL_ROUTE__ESCALATION__ENABLED="false",
        TOKENMILL_DEDUP__NEAR="false",
        TOKENMILL_DEDUP__SEMANTIC="false",
    )
    try:
        pool = EnginePool(config.tiers)
        m = run_job(config, job_id="judged", pool=pool).manifest.as_json()  # the engines kept, for below
        judged = run_judge(config, rows)
        tokenizer, context = pool.tokenizer("large"), pool.context_length("large")
    finally:
        shutdown_engines()
    ledger = read_kind(tmp_path / "output", "ledger", "judged").to_pylist()
    assert {r["id"] for r in ledger if r["kind"] == "output" and r["judge"] in VERDICTS[:3]} == {"alpha", "bravo"}
    asked = {r["id"]: r["prompt_tokens"] for r in ledger if r["kind"] == "judge"}
    assert m["judge"]["paid"] == 2 and asked == {
        d["id"]: len(fitted_prompt(config.checks.judge, tokenizer, context, d["text"], good)[1]) for d in docs
    }

    assert len(judged) == 4 and all(isinstance(j["answer"], str) for j in judged), judged  # an answer each
    assert all(j["verdict"] in (True, False, None) for j in judged)
    result = calibrate([{**r, "judge": j["verdict"]} for r, j in zip(rows, judged)], config.checks)
    for half in ("calibration", "test"):
        judge = result["after"][half]["judge"]
        assert judge["recall"]["n"] == 1 and judge["tp"] + judge["fp"] == sum(
            j["verdict"] is True for r, j in zip(rows, judged) if r["split"] == half
        )
