"""The LLM judge (`checks.judge`) in jobs, on the fake engine with scripted verdicts: a follow-up wave on the judge
tier's worker over the outputs that passed every cheap check, its verdict the output's `judge` flag (`acceptable`
only when it keeps it), its cost a ledger row of kind `judge` charged to the record it judged, the ledger still
adding up to every GPU-second held; a rerun pays for no verdict twice, and a judge that fails leaves every record
accounted for."""

import json

import pyarrow.compute as pc
import pytest
from rich.console import Console

from pipeline import run_job
from pipeline.cli.jobs import summary_table
from pipeline.generate.engine import ENGINES, EnginePool
from pipeline.output.ledger import connect, summary
from pipeline.output.manifest import Manifest
from tests.conftest import read_kind
from tests.engines import OneCallEngine
from tests.jobs import assert_exactly_once, scalar

DOC = (
    "The Artistic License lets anyone copy and distribute the Standard Version of the Package, provided the "
    "copyright notice is kept. Modified versions must be clearly documented and renamed. The Package is "
    "provided as is, without warranty."
)
GOOD = "The Artistic License lets anyone copy the Standard Version; modified versions must be renamed."
ECHO = "Summarize the following document in a few sentences."  # the prompt given back: `copied`
RUBRIC = "JUDGE {document} SUMMARY {summary} Answer KEEP or BAD."
# Each document's verdict, scripted by the word that opens it; `echo`'s output fails a cheap check: never judged.
VERDICTS = {"alpha": "KEEP", "bravo": "BAD", "charlie": "Maybe", "delta": "KEEP"}


def corpus(tmp_path) -> dict:
    docs = [{"id": word, "text": f"Notice {word}. {DOC}", "tenant": "acme"} for word in [*VERDICTS, "echo"]]
    docs.append({"id": "alpha-again", "text": docs[0]["text"], "tenant": "acme"})  # served alpha's output
    (tmp_path / "input").mkdir()
    (tmp_path / "input" / "a.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    return {"ids": [d["id"] for d in docs], "bad_records": 0}


def judged_config(make_config, **overrides):
    return make_config(
        **{
            "dedup__near": False,
            "dedup__semantic": False,
            "checks__judge": {"tier": "large", "rubric": RUBRIC},
            "tiers__small__fake__answers": {"Notice echo.": ECHO, "Notice ": GOOD},
            "sampling__max_tokens": 128,  # the whole scripted summary, not one cut off
            "tiers__large__fake__answers": {f"JUDGE Notice {w}.": a for w, a in VERDICTS.items()},
            **overrides,
        }
    )


def test_the_judge_runs_on_outputs_that_passed_the_checks_and_its_cost_is_charged_to_them(make_config, tmp_path):
    ids = corpus(tmp_path)
    config = judged_config(make_config)
    m = run_job(config, job_id="j1", pool=EnginePool(config.tiers), release_engines=True).manifest.as_json()
    assert m["status"] == "succeeded" and m["counts"]["outputs"] == 6
    ledger = read_kind(tmp_path / "output", "ledger", "j1")
    rows = {r["id"]: r for r in ledger.to_pylist() if r["kind"] == "output"}
    assert {i: r["judge"] for i, r in rows.items()} == {
        "alpha": "keep",
        "alpha-again": "keep",  # the same output, the same verdict
        "bravo": "bad",
        "charlie": "no_verdict",
        "delta": "keep",
        "echo": None,  # failed a cheap check: not asked
    }
    assert {i for i, r in rows.items() if r["acceptable"]} == {"alpha", "alpha-again", "delta"}
    assert rows["echo"]["copied"] and not rows["echo"]["acceptable"]
    # One verdict paid per judged output, by the record that asked (a duplicate pays nothing), on the judge's tier.
    judged = [r for r in ledger.to_pylist() if r["kind"] == "judge"]
    assert sorted(r["id"] for r in judged) == ["alpha", "bravo", "charlie", "delta"]
    assert all(r["tier"] == "large" and r["busy_gpu_seconds"] > 0 and r["prompt_tokens"] > 0 for r in judged)
    assert all(r["acceptable"] is None and r["judge"] is None for r in judged)  # a charge, not a document
    assert m["judge"]["judged"] == 5 and m["judge"]["verdicts"] == {"bad": 1, "keep": 3, "no_verdict": 1}
    assert m["judge"]["paid"] == 4
    assert m["judge"]["cost_usd"] == pytest.approx(sum(r["cost_usd"] for r in judged))
    assert m["cost"]["gpu_seconds_by_kind"]["judge"] == pytest.approx(sum(r["gpu_seconds"] for r in judged))
    assert_exactly_once(tmp_path / "output", "j1", ids, tmp_path / "state.db")  # the ledger adds up to held
    # The headline figure: every row's cost, the judge's included, over the acceptable outputs.
    (total,) = summary(connect(str(tmp_path / "output")), [], job_id="j1").to_pylist()
    assert total["acceptable"] == 3 and total["documents"] == 6
    assert float(total["cost_per_acceptable_usd"]) == pytest.approx(pc.sum(ledger["cost_usd"]).as_py() / 3)

    # Committed again (forced): every item and verdict is in the catalog already; nothing is generated or paid.
    again = run_job(
        config, job_id="j1", pool=EnginePool(config.tiers), partitions=list(m["partitions"]), release_engines=True
    )
    after = read_kind(tmp_path / "output", "ledger", "j1")
    assert sorted(r["id"] for r in after.to_pylist() if r["kind"] == "judge") == sorted(r["id"] for r in judged)
    assert again.manifest.as_json()["judge"] == m["judge"]
    # A later job over the same documents: outputs and verdicts from the cache, no verdict paid again.
    m2 = run_job(config, job_id="j2", pool=EnginePool(config.tiers), release_engines=True).manifest.as_json()
    rows2 = {r["id"]: r for r in read_kind(tmp_path / "output", "ledger", "j2").to_pylist() if r["kind"] == "output"}
    assert {i: r["judge"] for i, r in rows2.items()} == {i: r["judge"] for i, r in rows.items()}
    assert m2["judge"]["paid"] == 0 and "judge" not in m2["cost"]["gpu_seconds_by_kind"]


class _BrokenJudge(OneCallEngine):
    """The judge tier's engine failing on every request (each alone, after its share of engine time)."""

    def __init__(self, tier):
        pass

    def generate(self, prompts, max_tokens, sampling):
        raise RuntimeError("simulated CUDA error on the judge's tier")


def test_a_judge_that_fails_leaves_every_output_served_unjudged_and_not_acceptable(make_config, tmp_path):
    ids = corpus(tmp_path)
    config = judged_config(make_config)
    pool = EnginePool(
        config.tiers, factory=lambda tier: (_BrokenJudge if tier.model.endswith("large") else ENGINES["fake"])(tier)
    )
    m = run_job(config, job_id="jf", pool=pool, release_engines=True).manifest.as_json()
    assert m["status"] == "succeeded" and m["counts"]["outputs"] == 6 and m["counts"]["quarantined"] == 0
    ledger = read_kind(tmp_path / "output", "ledger", "jf")
    rows = {r["id"]: r for r in ledger.to_pylist() if r["kind"] == "output"}
    assert {i for i, r in rows.items() if r["judge"] == "unjudged"} == {
        "alpha",
        "alpha-again",
        "bravo",
        "charlie",
        "delta",
    }
    assert not any(r["acceptable"] for r in rows.values())
    assert m["judge"]["verdicts"] == {"unjudged": 5} and m["judge"]["paid"] == 0
    # The judge's engine time is billed as failed attempts of the records it was judging.
    failed = sorted(r["id"] for r in ledger.to_pylist() if r["kind"] == "failed_attempt")
    assert failed == ["alpha", "bravo", "charlie", "delta"]
    assert_exactly_once(tmp_path / "output", "jf", ids, tmp_path / "state.db")


def test_an_escalated_output_is_judged_after_its_escalation_on_the_escalation_tier(make_config, tmp_path):
    """With escalation on, the judge runs on the escalation tier, after the escalation: on the output served."""
    ids = corpus(tmp_path)
    large = {f"JUDGE Notice {w}.": a for w, a in VERDICTS.items()} | {"Notice echo.": ECHO, "Notice ": GOOD}
    config = judged_config(
        make_config,
        routing=True,
        route__rules=[],
        route__escalation__min_mean_logprob=-6.9,  # the fake's confidence splits the documents around it
        tiers__large__fake__answers=large,
    )
    m = run_job(config, job_id="je", pool=EnginePool(config.tiers), release_engines=True).manifest.as_json()
    ledger = read_kind(tmp_path / "output", "ledger", "je")
    rows = {r["id"]: r for r in ledger.to_pylist() if r["kind"] == "output"}
    escalated = {i for i, r in rows.items() if r["escalated"]}
    assert escalated and escalated != set(rows), "some outputs escalated, some not: both paths judged"
    assert {i: r["judge"] for i, r in rows.items()} == {
        "alpha": "keep",
        "alpha-again": "keep",
        "bravo": "bad",
        "charlie": "no_verdict",
        "delta": "keep",
        "echo": None,
    }
    judged = [r for r in ledger.to_pylist() if r["kind"] == "judge"]
    assert sorted(r["id"] for r in judged) == ["alpha", "bravo", "charlie", "delta"]
    assert_exactly_once(tmp_path / "output", "je", ids, tmp_path / "state.db")
    console = Console(record=True, width=200)
    console.print(summary_table(Manifest.parse(m)))
    assert f"{m['judge']['judged']} judged (bad 1, keep 3, no verdict 1); 4 paid" in console.export_text()


def test_a_judge_on_another_tier_than_the_escalation_tier_is_refused(make_config):
    with pytest.raises(ValueError, match="checks.judge.tier 'small' is not the escalation tier 'large'"):
        make_config(routing=True, checks__judge={"tier": "small"})


def _no_judge_engine(tier):
    from pipeline.generate.engine_api import EngineStartError

    if tier.model.endswith("large"):
        raise EngineStartError("no GPU for the judge's model")
    return ENGINES["fake"](tier)


def test_a_judge_tier_that_cannot_start_fails_the_job_and_its_rerun_judges_paying_no_summary_twice(
    make_config, tmp_path
):
    ids = corpus(tmp_path)
    config = judged_config(make_config)
    with pytest.raises(Exception, match="tier large: no GPU for the judge's model"):
        run_job(config, job_id="js", pool=EnginePool(config.tiers, factory=_no_judge_engine), release_engines=True)
    db = tmp_path / "state.db"
    summaries = scalar(db, "select count(*) from items where job_id='js' and tier='small'")
    assert summaries == 5 and not read_kind(tmp_path / "output", "ledger", "js").num_rows  # paid, kept, not committed
    m = run_job(config, job_id="js", pool=EnginePool(config.tiers), release_engines=True).manifest.as_json()
    assert m["status"] == "succeeded" and m["judge"]["verdicts"] == {"bad": 1, "keep": 3, "no_verdict": 1}
    assert scalar(db, "select count(*) from items where job_id='js' and tier='small'") == summaries
    assert_exactly_once(tmp_path / "output", "js", ids, db)
