"""The eval's offline parts, without an engine: policy scoring, escalation reasons, reuse false hits,
the hold-out reader and the in-place config edit. The end-to-end eval on the real model is in
tests/engine/test_real_model.py."""

from __future__ import annotations

import pyarrow as pa
import pytest
import yaml

from pipeline.config import load_config
from pipeline.evals.apply import ApplyError, apply_values, chosen_values
from pipeline.evals.evaluate import EvalError, read_labels, split
from pipeline.evals.policies import NO_LOGPROB, Outcomes, Policy, cheapest, grid, logprob_thresholds, rate, score
from pipeline.evals.reuse import reuse_quality
from pipeline.evals.runs import TierRun
from pipeline.generate.followup import escalation_reason
from tests.conftest import REPO, TINY_CONFIG


def run(
    tier: str,
    summaries: dict[str, str],
    usd: float,
    logprob: float = -0.5,
    finish: str = "stop",
    unfaithful: dict[str, int] | None = None,
) -> TierRun:
    ids = list(summaries)
    return TierRun(
        tier=tier,
        summary=summaries,
        finish_reason={i: finish for i in ids},
        mean_logprob={i: logprob for i in ids},
        output_tokens={i: 10 for i in ids},
        usd={i: usd for i in ids},
        measures={i: {"unfaithful_terms": (unfaithful or {}).get(i, 0)} for i in ids},
        engine_seconds=1.0,
        failed={},
    )


@pytest.fixture
def config(tmp_path):
    return load_config(TINY_CONFIG, environ={"TOKENMILL_HOME": str(tmp_path)})


def test_policies_are_scored_by_the_acceptable_share_they_serve_against_all_large(config):
    ids = ["a", "b", "c", "d"]
    small = run("small", {i: f"s {i}" for i in ids}, usd=0.001, unfaithful={"a": 1})
    small.mean_logprob.update({"b": -3.0})
    large = run("large", {i: f"l {i}" for i in ids}, usd=0.004)
    # Acceptable (no check failed) per tier: all-large serves 3 of 4; ROUGE-L is only the secondary figure.
    outcomes = Outcomes(
        small_ok={"a": False, "b": False, "c": True, "d": True},
        large_ok={"a": True, "b": True, "c": True, "d": False},
        agreement={"a": 0.2, "b": 0.4, "c": 1.0, "d": 0.9},
    )
    # Everything kept on the small tier: 2 of 4 acceptable, two thirds of all-large's 3, at its cost.
    plain = score(Policy(None, NO_LOGPROB, False, False), ids, small, large, outcomes, None, config)
    assert plain["acceptable"] == rate(2, 4) and plain["quality_kept"] == pytest.approx(2 / 3, abs=1e-4)
    assert plain["quality_kept_ci95"] == [pytest.approx(b * 4 / 3, abs=1e-4) for b in rate(2, 4)["ci95"]]
    assert plain["rouge_l_kept"] == pytest.approx((0.2 + 0.4 + 1.0 + 0.9) / 4, abs=1e-4)
    assert plain["small_share"] == 1.0 and plain["cost_per_1k_usd"] == pytest.approx(1.0)
    # Escalating the unfaithful output and the low-confidence one: both then served by large (acceptable
    # there), paid twice; d stays on small, where it is acceptable and large's is not: more than all-large keeps.
    both = score(Policy(None, -2.0, False, True), ids, small, large, outcomes, None, config)
    assert both["escalated_by"] == {"unfaithful": 1, "low_logprob": 1}
    assert both["acceptable"]["rate"] == 1.0 and both["quality_kept"] == pytest.approx(4 / 3, abs=1e-4)
    assert both["rouge_l_kept"] == pytest.approx((1 + 1 + 1.0 + 0.9) / 4, abs=1e-4)
    assert both["cost_per_1k_usd"] == pytest.approx(1000 * (2 * 0.005 + 2 * 0.001) / 4)
    # The router sends p < threshold straight to the large tier: paid once, on large.
    routed = score(
        Policy(0.5, NO_LOGPROB, False, False),
        ids,
        small,
        large,
        outcomes,
        {"a": 0.1, "b": 0.9, "c": 0.9, "d": 0.9},
        config,
    )
    assert routed["small_share"] == 0.75 and routed["cost_per_1k_usd"] == pytest.approx(1000 * (0.004 + 3 * 0.001) / 4)
    assert routed["quality_kept"] == 1.0
    # The cheapest policy keeping the target of all-large's acceptable share.
    rows = [plain, both, routed]
    assert cheapest(rows, 1.4) is None
    assert cheapest(rows, 1.2) == both
    assert cheapest(rows, 0.95) == routed  # cheaper than escalating twice
    assert cheapest(rows, 0.6) == plain
    # Where all-large serves nothing acceptable either, nothing is lost against it.
    none_ok = Outcomes(dict.fromkeys(ids, False), dict.fromkeys(ids, False), outcomes.agreement)
    assert (
        score(Policy(None, NO_LOGPROB, False, False), ids, small, large, none_ok, None, config)["quality_kept"] == 1.0
    )


def test_outcomes_read_each_tiers_output_checks(config):
    from pipeline.generate.quality import measure

    doc = "The committee approved the northern office budget and the hiring of two engineers in March."
    summaries = {"loop": "budget budget budget " * 20, "fine": "The committee approved the northern office budget."}
    small, large = run("small", summaries, usd=0.001), run("large", {**summaries, "loop": summaries["fine"]}, usd=0.004)
    for tier in (small, large):
        tier.measures.update({i: measure(tier.summary[i], doc) for i in summaries})
    outcomes = Outcomes.of(small, large, ["loop", "fine"], {"loop": 0.1, "fine": 1.0}, config.checks)
    assert outcomes.small_ok == {"loop": False, "fine": True} and outcomes.large_ok == {"loop": True, "fine": True}


def test_the_grid_covers_every_signal_and_threshold(config):
    small = run("small", {"a": "x", "b": "y"}, usd=0.001)
    thresholds = logprob_thresholds(small, ["a", "b"])
    assert thresholds[0] is NO_LOGPROB and thresholds[1:] == [-0.5]
    policies = grid(True, thresholds)
    assert len(policies) == 20 * 2 * 2 * 2  # router off + 19 thresholds, 2 logprob settings, 2 × 2 signals
    assert len(grid(False, thresholds)) == 8


def test_escalation_reasons_in_their_order(config):
    c = config.model_copy(
        update={
            "route": config.route.model_copy(
                update={
                    "escalation": config.route.escalation.model_copy(
                        update={"enabled": True, "min_mean_logprob": -2.0, "on_truncation": True, "on_unfaithful": True}
                    )
                }
            )
        }
    )
    item = {"tier": "small", "summary": "ok", "finish_reason": "stop", "mean_logprob": -1.0, "unfaithful_terms": 0}
    assert escalation_reason(item, c) is None
    assert escalation_reason({**item, "summary": " "}, c) == "empty"
    assert escalation_reason({**item, "unfaithful_terms": 2, "finish_reason": "length"}, c) == "unfaithful"
    assert escalation_reason({**item, "finish_reason": "length", "mean_logprob": -5.0}, c) == "truncated"
    assert escalation_reason({**item, "mean_logprob": -5.0}, c) == "low_logprob"
    assert escalation_reason({**item, "unfaithful_terms": None}, c) is None, "items stored before the signal existed"
    off = c.model_copy(
        update={
            "route": c.route.model_copy(
                update={
                    "escalation": c.route.escalation.model_copy(
                        update={"min_mean_logprob": None, "on_unfaithful": False}
                    )
                }
            )
        }
    )
    assert escalation_reason({**item, "mean_logprob": -50.0, "unfaithful_terms": 3}, off) is None


def test_reuse_false_hits_count_labels_and_introduced_claims():
    records = pa.table(
        {
            "id": ["o1", "v1", "o2", "v2", "o3", "v3", "v4"],
            "text": [
                "Acme sold 12 pumps.",
                "Mirror. Acme sold 12 pumps.",
                "Globex hired Dana.",
                "Globex hired Lee.",
                "The plan is fine.",
                "The plan is not fine.",
                "Acme sold 12 pumps. Footer.",
            ],
            "reuse": [None, "near_duplicate", None, "semantic", None, None, None],
            "gen_id": [None, "o1", None, "o2", None, None, None],
            "similarity": [None, 0.9, None, 0.95, None, None, None],
            "item_key": ["k1", "k1v", "k2", "k2v", "k3", "k3v", "k1"],
        }
    )
    labels = {
        "v1": {"variant_of": "o1", "should_reuse": True},
        "v2": {"variant_of": "o2", "should_reuse": True},
        "v3": {"variant_of": "o3", "should_reuse": False},
        "v4": {"variant_of": "o1", "should_reuse": True},
    }
    large = run(
        "large",
        {
            "o1": "Acme sold 12 pumps.",
            "v1": "Acme sold 12 pumps.",
            "o2": "Globex hired Dana.",
            "v2": "Globex hired Lee.",
            "o3": "x",
            "v3": "y",
            "v4": "z",
        },
        usd=0.0,
    )
    out = reuse_quality(records, labels, large)
    # v1 reuses a faithful summary; v2's reused summary names Dana, whom its own document does not.
    assert out["by_kind"]["near_duplicate"]["false_hits"] == 0 and out["by_kind"]["semantic"]["false_hits"] == 1
    assert out["false_hit_samples"][0]["introduced"] == ["Dana"]
    assert out["total"]["reused"] == 2 and out["total"]["ci95"][1] > 0.5  # two pairs prove little, and it says so
    # Labelled pairs: v4 reused exactly (same item key as o1), v3 (must not) was generated on its own.
    assert out["labelled"]["should_reuse"] == {"pairs": 3, "reused": 3, "share_reused": 1.0}
    assert out["labelled"]["must_not_reuse"] == {"pairs": 1, "reused": 0, "share_reused": 0.0}


def test_hold_out_reader_names_the_bad_line(tmp_path):
    path = tmp_path / "h.jsonl"
    path.write_text('{"id": "a", "text": "x"}\n{"text": "no id"}\n')
    with pytest.raises(EvalError, match=r"h.jsonl:2: expected a JSON object with `id`"):
        read_labels(path)
    path.write_text('{"id": 7, "text": "x", "variant_of": "b", "should_reuse": false}\n')
    assert read_labels(path) == {"7": {"variant_of": "b", "should_reuse": False}}


def test_the_split_is_stable_and_disjoint():
    ids = [f"doc-{i:04d}" for i in range(200)]
    train, test = split(ids)
    assert split(list(reversed(ids)))[0] == list(reversed(train))
    assert not set(train) & set(test) and len(train) + len(test) == 200 and 60 < len(train) < 140


def test_update_config_edits_in_place_keeping_comments(tmp_path):
    text = (REPO / "configs" / "local.yaml").read_text()
    chosen = {"router_threshold": 0.35, "min_mean_logprob": -1.25, "on_truncation": False, "on_unfaithful": True}
    out = apply_values(
        text, chosen_values(chosen, "small", "large", "/models/eval/router.json"), "tokenmill eval 2026-12-01"
    )
    parsed = yaml.safe_load(out)
    assert parsed["route"]["escalation"] == {
        "enabled": True,
        "to_tier": "large",
        "min_mean_logprob": -1.25,
        "on_truncation": False,
        "on_unfaithful": True,
    }
    assert parsed["route"]["router"] == "/models/eval/router.json" and parsed["route"]["default_tier"] == "small"
    assert "# tokenmill eval 2026-12-01" in out
    # Everything else is untouched, comments included.
    changed = (
        "min_mean_logprob:",
        "on_truncation:",
        "on_unfaithful:",
        "to_tier:",
        "enabled:",
        "default_tier:",
        "router:",
    )
    untouched = [line for line in text.splitlines() if not line.strip().startswith(changed)]
    assert all(line in out.splitlines() for line in untouched)
    (tmp_path / "c.yaml").write_text(out)
    assert (
        load_config(tmp_path / "c.yaml", environ={"TOKENMILL_HOME": str(tmp_path)}).route.escalation.min_mean_logprob
        == -1.25
    )
    # A policy without the router clears it; missing parents are added.
    bare = apply_values(
        "tiers:\n  small:\n    model: m\n",
        chosen_values({**chosen, "router_threshold": None}, "small", "large", None),
        "e",
    )
    assert yaml.safe_load(bare)["route"] == {
        "default_tier": "small",
        "router": None,
        "escalation": {
            "enabled": True,
            "to_tier": "large",
            "min_mean_logprob": -1.25,
            "on_truncation": False,
            "on_unfaithful": True,
        },
    }
    # After an eval chose all-large, the next choice of a mix sends items to the small tier again.
    after = apply_values(
        apply_values(text, chosen_values({"all_large": True}, "small", "large", None), "e"),
        chosen_values({**chosen, "router_threshold": None}, "small", "large", None),
        "e",
    )
    assert yaml.safe_load(after)["route"]["default_tier"] == "small"


def test_update_config_refuses_a_layout_it_cannot_edit():
    with pytest.raises(ApplyError, match="set by hand: route.escalation.enabled: true"):
        apply_values("route: {escalation: {enabled: false}}\n", {("route", "escalation", "enabled"): True}, "e")
    # A quoted key is not found, so a second `route:` block would be added and silently drop the rules.
    quoted = '"route":\n  default_tier: small\n  rules:\n    - {name: x, tier: large}\n'
    with pytest.raises(ApplyError, match="set by hand"):
        apply_values(quoted, {("route", "router"): None}, "e")


def test_an_eval_never_replaces_the_router_a_config_uses(tmp_path):
    from pipeline.cli.evals import write_outputs

    (tmp_path / "router.json").write_text('{"threshold": 0.35}')
    result = {"routing": {"router_artifact": {"threshold": 0.5}, "chosen": None}, "labels": [{"text": "t"}]}
    assert write_outputs(result, tmp_path) == tmp_path / "router.candidate.json"
    assert (tmp_path / "router.json").read_text() == '{"threshold": 0.35}'
    assert (tmp_path / "labels.jsonl").read_text() == '{"text": "t"}\n'
    assert "router_artifact" not in __import__("json").loads((tmp_path / "eval.json").read_text())["routing"]


def test_too_small_or_empty_hold_outs_are_refused_before_any_engine(config, tmp_path):
    from pipeline.evals.evaluate import run_eval

    class NoEngines:  # the eval must refuse before it asks for one
        def __getattr__(self, name):
            raise AssertionError(f"engine pool used: {name}")

    path = tmp_path / "h.jsonl"
    path.write_text('{"id": "a", "text": "   "}\n')
    with pytest.raises(EvalError, match="no valid document to evaluate .1 quarantined"):
        run_eval(config, path, pool=NoEngines())
    path.write_text("".join(f'{{"id": "d{i}", "text": "Document number {i} about pumps."}}\n' for i in range(10)))
    with pytest.raises(EvalError, match="documents fall in the test half: at least 20 are needed"):
        run_eval(config, path, pool=NoEngines())
    one_price = config.model_copy(update={"tiers": {"only": config.tiers["small"]}})
    with pytest.raises(EvalError, match="two tiers of different price"):
        run_eval(one_price, path, pool=NoEngines())


def test_all_large_chosen_sets_the_default_tier():
    values = chosen_values({"all_large": True, "router_threshold": None}, "small", "large", "/r.json")
    assert values == {
        ("route", "default_tier"): "large",
        ("route", "escalation", "enabled"): False,
        ("route", "router"): None,
    }


def test_policies_escalate_outputs_that_fail_a_check_as_the_job_does(config):
    """The eval's policies see each output's check measures (quality.measure), so an output the job would
    escalate as `degenerate` is scored as escalated: on large, paid twice."""
    from pipeline.generate.quality import measure

    doc = "The committee approved the northern office budget and the hiring of two engineers in March."
    ids = ["loop", "fine"]
    small = run(
        "small", {"loop": "budget budget budget " * 20, "fine": "The committee approved the budget."}, usd=0.001
    )
    small.measures.update({i: measure(small.summary[i], doc) for i in ids})
    large = run("large", {i: f"l {i}" for i in ids}, usd=0.004)
    outcomes = Outcomes({"loop": False, "fine": True}, {"loop": True, "fine": False}, {"loop": 0.1, "fine": 0.9})
    plain = score(Policy(None, NO_LOGPROB, False, False), ids, small, large, outcomes, None, config)
    assert plain["escalated_by"] == {"degenerate": 1} and plain["small_share"] == 0.5
    assert plain["acceptable"]["rate"] == 1.0 and plain["rouge_l_kept"] == pytest.approx((1.0 + 0.9) / 2, abs=1e-4)
    off = config.model_copy(
        update={
            "route": config.route.model_copy(
                update={"escalation": config.route.escalation.model_copy(update={"on_degenerate": False})}
            )
        }
    )
    assert score(Policy(None, NO_LOGPROB, False, False), ids, small, large, outcomes, None, off)["escalated_by"] == {}


def test_the_eval_writes_what_chose_the_routing_and_the_run_prints_it_beside_the_tiers_shares():
    from pipeline.cli.jobs import routing_line
    from pipeline.evals.apply import decided_by
    from pipeline.output.manifest import Manifest

    routing = {
        "test_documents": 30,
        "target_quality": 0.95,
        "all_large": {"cost_per_1k_usd": 12.88, "acceptable": {"rate": 0.2}},
        "all_small": {"quality_kept": 0.8333, "acceptable": {"rate": 0.1667}},
        "chosen": {"all_large": True, "cost_per_1k_usd": 12.88},
    }
    line = decided_by(routing, "small", "large", "2026-12-07")
    assert (
        line == "tokenmill eval 2026-12-07, 30 test documents: no mix with small keeps 95% of all-large's acceptable "
        "share for less than all-large (all-small keeps 83.3%: acceptable 16.7% against 20.0%)"
    )
    one = {
        "job_id": "j",
        "status": "succeeded",
        "counts": {"outputs": 60, "by_tier": {"large": 60}},
        "routing": {"escalated": 0},
    }
    assert routing_line(Manifest.parse(one), line) == f"every output on large: {line}"
    routing["chosen"] = {
        "small_share": 0.6,
        "escalated_share": 0.25,
        "quality_kept": 0.962,
        "acceptable": {"rate": 0.1923},
        "cost_per_1k_usd": 5.1,
    }
    mixed = decided_by(routing, "small", "large", "2026-12-07")
    assert (
        "60% kept on small, 25% escalated, 96.2% of all-large's acceptable share (acceptable 19.2% against 20.0%) "
        "at $5.100 per 1k (all-large $12.880)" in mixed
    )
    two = {
        "job_id": "j",
        "status": "succeeded",
        "counts": {"outputs": 60, "by_tier": {"small": 45, "large": 15}},
        "routing": {"escalated": 15},
    }
    assert routing_line(Manifest.parse(two), mixed) == f"small 75%, large 25%; 15 escalated: {mixed}"
    assert routing_line(Manifest.parse(two)) == "small 75%, large 25%; 15 escalated"
