"""Two tiers: rules, the learned router and its calibration, escalation and map-reduce (fake engine)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from typer.testing import CliRunner

from pipeline import run_job
from pipeline.cli import app
from pipeline.config import ConfigError, RouteConfig, RouteRule, load_config
from pipeline.dev.labels import example_labels
from pipeline.route.router import (
    FEATURES,
    Router,
    RouterError,
    calibrated_model,
    calibration_curve,
    read_labels,
    text_features,
    train,
    train_router,
)
from pipeline.route.rules import assign_tiers
from tests.conftest import TINY_CONFIG, read_kind


def table(rows):
    return pa.table(
        {
            "id": [r[0] for r in rows],
            "tenant": [r[1] for r in rows],
            "text": [r[2] for r in rows],
            "metadata": [json.dumps(r[3]) if r[3] else None for r in rows],
        }
    )


def test_rules_decide_in_order_and_say_why():
    config = RouteConfig(
        default_tier="small",
        rules=[
            RouteRule(name="vip", tier="large", tenants=["acme"]),
            RouteRule(name="legal", tier="large", metadata={"kind": "contract"}),
            RouteRule(name="long", tier="large", min_chars=50),
            RouteRule(name="urgent", tier="large", regex=r"(?i)\burgent\b"),
        ],
    )
    out = assign_tiers(
        table(
            [
                ("a", "acme", "short", None),
                ("b", "globex", "short", {"kind": "contract"}),
                ("c", "globex", "x" * 60, None),
                ("d", "globex", "URGENT: call back", None),
                ("e", "globex", "plain", None),
            ]
        ),
        config,
    )
    assert out["tier"].to_pylist() == ["large", "large", "large", "large", "small"]
    assert out["route_reason"].to_pylist() == ["rule:vip", "rule:legal", "rule:long", "rule:urgent", "default"]


def test_a_rule_naming_an_unknown_tier_or_a_bad_regex_is_a_config_error():
    with pytest.raises(ConfigError, match=r"route.rules\[x\].tier 'huge' is not one of tiers"):
        load_config(TINY_CONFIG, environ={"TOKENMILL_ROUTE__RULES": '[{"name": "x", "tier": "huge"}]'})
    with pytest.raises(ConfigError, match="regex does not compile"):
        load_config(TINY_CONFIG, environ={"TOKENMILL_ROUTE__RULES": '[{"name": "x", "tier": "large", "regex": "("}]'})


def test_router_train_then_eval_picks_the_cheapest_threshold_that_keeps_quality(tmp_path, tiny_models):
    labels, artifact = tmp_path / "labels.jsonl", tmp_path / "router.json"
    example_labels(labels, 300)
    runner = CliRunner()
    trained = runner.invoke(
        app, ["router", "train", "--config", str(TINY_CONFIG), "--labels", str(labels), "--out", str(artifact)]
    )
    assert trained.exit_code == 0, trained.output
    result = runner.invoke(
        app,
        [
            "router",
            "eval",
            "--config",
            str(TINY_CONFIG),
            "--labels",
            str(labels),
            "--router",
            str(artifact),
            "--target-quality",
            "0.95",
            "--format",
            "json",
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[: result.output.rindex("}") + 1])
    rows, chosen = report["rows"], report["chosen"]
    assert rows[0]["large_share"] == 0.0 and rows[0]["threshold"] == 0.0  # everything small: cheapest
    all_large = [r for r in rows if r["large_share"] == 1.0]
    assert all_large and all_large[0]["quality_kept"] == 1.0
    assert chosen["quality_kept"] >= 0.95
    assert all(r["cost_per_item_usd"] >= chosen["cost_per_item_usd"] for r in rows if r["quality_kept"] >= 0.95)
    assert 0 < chosen["large_share"] < 1, "the synthetic set has easy and hard items"
    curve = report["calibration"]
    assert sum(b["count"] for b in curve) == 300 and all(
        0 <= b["low"] <= b["mean_predicted"] <= b["high"] for b in curve
    )
    saved = json.loads(artifact.read_text())
    assert saved["threshold"] == chosen["threshold"] and saved["calibrated_target"] == 0.95
    router = Router.load(artifact)
    routed = router.route(["Short plain note about the team meeting."])
    assert routed[0][0] in ("small", "large") and 0 <= routed[0][1] <= 1
    shown = runner.invoke(
        app, ["router", "eval", "--config", str(TINY_CONFIG), "--labels", str(labels), "--router", str(artifact)]
    )
    assert shown.exit_code == 0, shown.output
    assert "calibration" in shown.output and "mean predicted" in shown.output, shown.output


def labelled(tmp_path, name, items, seed):
    return read_labels(example_labels(tmp_path / f"{name}.jsonl", items, seed=seed), "small", "large")


def test_the_router_is_calibrated_on_held_out_items(tmp_path):
    artifact = train(labelled(tmp_path, "train", 400, seed=3), "small", "large", 0.95)
    held_out = labelled(tmp_path, "held_out", 400, seed=11)
    router = Router(artifact)
    p, y = router.probabilities(held_out.texts), held_out.small_suffices(0.95)
    brier, base_rate = float(np.mean((p - y) ** 2)), float(y.mean() * (1 - y.mean()))
    assert brier < 0.75 * base_rate, f"Brier {brier:.3f} against {base_rate:.3f} for always predicting the share"
    curve = [b for b in calibration_curve(router, held_out, 0.95) if b["count"] >= 20]
    assert len(curve) >= 2 and sum(b["count"] for b in calibration_curve(router, held_out, 0.95)) == 400
    assert all(abs(b["mean_predicted"] - b["observed"]) < 0.2 for b in curve), curve
    observed = [b["observed"] for b in curve]
    assert observed[-1] - observed[0] > 0.4 and all(b >= a - 0.15 for a, b in zip(observed, observed[1:])), curve
    assert artifact["calibration"]["method"] == "sigmoid" and artifact["calibration"]["folds"] == 5


def test_the_folded_artifact_equals_the_calibrated_sklearn_model(tmp_path):
    data = labelled(tmp_path, "train", 200, seed=5)
    artifact = train(data, "small", "large", 0.95)
    x = (text_features(data.texts) - np.asarray(artifact["mean"])) / np.asarray(artifact["scale"])
    model = calibrated_model(x, data.small_suffices(0.95).astype(int))
    assert np.allclose(Router(artifact).probabilities(data.texts), model.predict_proba(x)[:, 1], atol=1e-12)


def test_the_artifact_round_trips_and_routes_without_sklearn(tmp_path):
    data = labelled(tmp_path, "train", 120, seed=7)
    path = tmp_path / "router.json"
    path.write_text(json.dumps(train(data, "small", "large", 0.95)))
    loaded = Router.load(path)
    assert loaded.artifact["features"] == FEATURES and len(loaded.weights) == len(FEATURES)
    assert np.array_equal(
        loaded.probabilities(data.texts), Router(json.loads(path.read_text())).probabilities(data.texts)
    )
    # Routing runs in every job: it must not pay sklearn's import (nor need it installed).
    probe = (
        "import json, sys; from pipeline.route.router import Router; "
        f"r = Router.load({str(path)!r}); print(json.dumps([r.route(['A short note.']), "
        "'sklearn' in sys.modules]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=Path(__file__).parents[2]
    )
    (tier, p), sklearn_loaded = json.loads(done.stdout)[0][0], json.loads(done.stdout)[1]
    assert (tier, p) == tuple(loaded.route(["A short note."])[0]) and not sklearn_loaded


def test_format_1_artifacts_still_route_and_unknown_formats_are_refused(tmp_path):
    artifact = train(labelled(tmp_path, "train", 60, seed=1), "small", "large", 0.95)
    path = tmp_path / "old.json"
    path.write_text(json.dumps({**artifact, "format": 1}))  # the same fields: an upgrade must not break routing
    assert Router.load(path).route(["A short note."]) == Router(artifact).route(["A short note."])
    path.write_text(json.dumps({**artifact, "format": 99}))
    with pytest.raises(RouterError, match="format 99 .* train it again with `tokenmill router train`"):
        Router.load(path)


def test_a_set_with_too_few_items_of_one_outcome_is_refused_clearly():
    texts = [f"Note {i} about the plan." for i in range(12)]
    with pytest.raises(
        RouterError, match="12 labelled items, 12 where small suffices .* at least 2 items of each outcome"
    ):
        train_router(texts, [1.0] * 12, [1.0] * 12, "small", "large", 0.95)
    with pytest.raises(RouterError, match="12 labelled items, 11 where small suffices"):
        train_router(texts, [1.0] * 11 + [0.1], [1.0] * 12, "small", "large", 0.95)
    with pytest.raises(RouterError, match="12 texts but 11 small"):
        train_router(texts, [1.0] * 11, [1.0] * 12, "small", "large", 0.95)
    # Three items of the rarer outcome: calibrated over three folds rather than refused.
    artifact = train_router(texts, [1.0] * 9 + [0.1] * 3, [1.0] * 12, "small", "large", 0.95)
    assert artifact["calibration"]["folds"] == 3 and artifact["trained_on"] == 12


def test_bad_labels_are_named_by_line(tmp_path):
    path = tmp_path / "l.jsonl"
    path.write_text('{"text": "a", "tier": "small"}\n{"text": "b", "tier": "medium"}\n')
    with pytest.raises(RouterError, match=r"l.jsonl:2: tier 'medium'"):
        read_labels(path, "small", "large")
    path.write_text('{"text": "a", "tier": "small"}\n' * 3)
    with pytest.raises(RouterError, match="at least 10"):
        read_labels(path, "small", "large")


def docs(n, prefix="d", words=40):
    body = "quarterly revenue growth customer order shipment delay invoice payment refund "
    return [{"id": f"{prefix}{i}", "tenant": "acme", "text": body * (words // 10) + f"Note {i}."} for i in range(n)]


def write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def looping(make_config, tmp_path, n: int, **overrides):
    """`n` documents of distinct topics as input, and two tiers with no rule, no near or semantic reuse and no
    confidence signal, whose small tier answers 24 tokens and loops on about half of them."""
    write(
        tmp_path / "input" / "a.jsonl",
        [{**d, "text": f"{d['text']} Topic {i} of {i * 7}."} for i, d in enumerate(docs(n))],
    )
    return make_config(
        routing=True,
        route__rules=[],
        dedup__near=False,
        dedup__semantic=False,
        route__escalation__min_mean_logprob=None,
        tiers__small__fake__loop_share=0.5,
        tiers__small__fake__output_tokens=24,
        **overrides,
    )


def test_escalation_regenerates_low_confidence_outputs_and_pays_both_attempts(make_config, tmp_path):
    write(tmp_path / "input" / "a.jsonl", docs(6))
    # Threshold 0: every small-tier output is "low confidence" (log-probabilities are negative).
    config = make_config(routing=True, route__escalation__min_mean_logprob=0.0, route__rules=[], dedup__near=False)
    m = run_job(config, job_id="esc").manifest.as_json()
    ledger = {r["id"]: r for r in read_kind(tmp_path / "output", "ledger", "esc").to_pylist()}
    assert all(r["escalated"] and r["attempts"] == 2 and r["tier"] == "large" for r in ledger.values())
    assert all(r["route_reason"] == "default" for r in ledger.values())
    assert m["routing"]["escalated"] == 6 and set(m["engines"]) == {"small", "large"}
    # Both attempts are in the cost: the ledger adds up to both engines' GPU-seconds.
    assert sum(r["gpu_seconds"] for r in ledger.values()) == pytest.approx(
        sum(e["gpu_seconds"] for e in m["engines"].values()), rel=1e-9
    )
    small_price, large_price = (config.tiers[t].price_per_gpu_hour for t in ("small", "large"))
    assert all(small_price < r["price_per_gpu_hour"] < large_price for r in ledger.values())

    again = run_job(config, job_id="esc").manifest.as_json()  # a rerun: nothing generated twice
    assert again["engines"] == m["engines"]
    cached = run_job(config, job_id="esc-2").manifest.as_json()  # another night: both attempts come from the cache
    assert cached["counts"]["by_source"] == {"cache_exact": 6} and cached["cost"]["cost_usd"] == 0
    assert "engines" not in cached or cached["engines"] == {}


def test_confident_outputs_stay_on_the_small_tier(make_config, tmp_path):
    write(tmp_path / "input" / "a.jsonl", docs(4))
    config = make_config(routing=True, route__escalation__min_mean_logprob=-1000.0, route__rules=[], dedup__near=False)
    m = run_job(config, job_id="calm").manifest.as_json()
    ledger = read_kind(tmp_path / "output", "ledger", "calm").to_pylist()
    assert {(r["tier"], r["escalated"], r["attempts"]) for r in ledger} == {("small", False, 1)}
    assert set(m["engines"]) == {"small"}, "an engine starts only for a tier that gets items"


def test_long_documents_are_quarantined_when_chunking_is_off(make_config, tmp_path):
    write(tmp_path / "input" / "a.jsonl", docs(1, words=3000))
    m = run_job(make_config(requests__long_documents="quarantine"), job_id="q").manifest.as_json()
    assert m["counts"]["by_reason"] == {"too_long": 1}


CPU_BLOCK_TOKENS = 128  # vLLM's KV block on the CPU: the prefix cache hits whole blocks only


def test_prefix_sharing_is_reported_against_what_is_possible(make_config, tmp_path):
    write(tmp_path / "input" / "a.jsonl", docs(12, words=200))
    m = run_job(make_config(dedup__near=False), job_id="px").manifest.as_json()
    p, tokens = m["prefix_cache"], m["tokens"]
    assert p["shareable_ratio"] > 0.5, "every prompt shares the system prompt and template"
    # 12 prompts share the system prompt, template and 200 words (about 245 tokens, more than one block),
    # so the engine must serve some of them from its prefix cache: 0 hits means caching is off or broken
    # (with enable_prefix_caching=false this test fails; its old `0 <= hit_ratio` passed).
    shared = tokens["shareable_prompt_tokens"] / 11
    assert shared > CPU_BLOCK_TOKENS, f"the test's prompts must share more than one block: {shared:.0f} tokens"
    cached = tokens["cached_prompt_tokens"]
    assert cached > 0 and cached % CPU_BLOCK_TOKENS == 0, f"{cached} cached prompt tokens: {p}"
    assert 0 < p["hit_ratio"] <= p["shareable_ratio"] and 0 < p["of_shareable"] <= 1


def test_which_outputs_escalate(make_config):
    from pipeline.generate.followup import needs_escalation

    config = make_config(routing=True, route__escalation__min_mean_logprob=-3.0, route__escalation__on_truncation=True)
    item = {"tier": "small", "summary": "fine", "mean_logprob": -1.0, "finish_reason": "stop", "chunks": 0}
    assert not needs_escalation(item, config)
    assert needs_escalation({**item, "mean_logprob": -4.0}, config)
    assert needs_escalation({**item, "finish_reason": "length"}, config)
    assert needs_escalation({**item, "summary": "  "}, config), "an empty output escalates"
    assert not needs_escalation({**item, "tier": "large", "mean_logprob": -9.0}, config), "already on the top tier"
    assert not needs_escalation({**item, "chunks": 3, "mean_logprob": -9.0}, config), "map-reduce outputs stay"
    assert not needs_escalation({**item, "mean_logprob": -9.0}, make_config()), "escalation off"


@pytest.mark.parametrize("escalate", [True, False])
def test_loops_are_flagged_alike_in_catalog_ledger_and_manifest_and_escalate_when_asked(
    make_config, tmp_path, escalate
):
    """A small tier that loops on some documents. Its loops are `degenerate` in the catalog (the
    measure), then either escalated (reason `degenerate`, the large tier's output served) or, escalation of
    loops off, served and flagged in the ledger and the manifest: the same count everywhere."""
    import sqlite3

    from pipeline.generate.quality import failed_checks

    config = looping(make_config, tmp_path, 24, route__escalation__on_degenerate=escalate)
    m = run_job(config, job_id="loops").manifest.as_json()
    with sqlite3.connect(tmp_path / "state.db") as c:
        c.row_factory = sqlite3.Row
        small = [dict(r) for r in c.execute("select * from items where job_id='loops' and tier='small'")]
    loops = {r["id"] for r in small if failed_checks(r, config.checks) == ["degenerate"]}
    assert 0 < len(loops) < len(small) == 24  # about half loop, by a hash of the request
    ledger = {r["id"]: r for r in read_kind(tmp_path / "output", "ledger", "loops").to_pylist()}
    if escalate:
        assert {i for i, r in ledger.items() if r["escalation_reason"] == "degenerate"} == loops
        assert all(ledger[i]["tier"] == "large" and not ledger[i]["degenerate"] for i in loops)
        assert m["routing"]["escalated_by"] == {"degenerate": len(loops)} and m["checks"]["degenerate"] == {}
    else:
        assert {i for i, r in ledger.items() if r["degenerate"]} == loops and not m["routing"]["escalated"]
        assert m["checks"]["degenerate"] == {"small": len(loops)}
        # The examples `tokenmill run` prints show the checks at work: a summary to keep, then a flagged one.
        from pipeline.cli.jobs import examples
        from pipeline.generate.quality import keep_rank

        shown = examples(config, "loops")
        assert [e["shows"] for e in shown[:2]] == ["acceptable", "degenerate"] and shown[1]["id"] in loops
        # The acceptable one is the one a reader would most likely keep (keep_rank), not the first by id.
        served = {r["id"]: r["summary"] for r in read_kind(tmp_path / "output", "outputs", "loops").to_pylist()}
        kept = [served[i] for i, r in ledger.items() if r["acceptable"]]
        assert ledger[shown[0]["id"]]["acceptable"] and keep_rank(shown[0]["summary"]) == max(map(keep_rank, kept))
    assert all(r["copied"] is False for r in ledger.values()) and m["checks"]["copied"] == {}


def test_outputs_still_failing_a_check_after_escalation_are_quarantined_with_its_name(make_config, tmp_path):
    """With `checks.quarantine: [degenerate]`, a record whose small-tier output loops is escalated;
    where the large tier loops too, the record is quarantined with reason `degenerate` and both paid attempts
    stay in the ledger (kind invalid_output); every other record is served. Nothing lost, nothing free."""
    import sqlite3

    from pipeline.generate.quality import failed_checks

    config = looping(
        make_config,
        tmp_path,
        40,
        checks__quarantine=["degenerate"],
        tiers__large__fake__loop_share=0.5,
        tiers__large__fake__output_tokens=24,
    )  # loops aside, they stop
    m = run_job(config, job_id="rejects").manifest.as_json()
    with sqlite3.connect(tmp_path / "state.db") as c:
        c.row_factory = sqlite3.Row
        items = [dict(r) for r in c.execute("select * from items where job_id='rejects'")]
    loops = {
        tier: {r["id"] for r in items if r["tier"] == tier and failed_checks(r, config.checks)}
        for tier in ("small", "large")
    }
    both = loops["small"] & loops["large"]
    assert both and loops["small"] - both, loops  # some loop on both tiers, some are saved by escalation
    output = tmp_path / "output"
    quarantine = {r["id"]: r for r in read_kind(output, "quarantine", "rejects").to_pylist()}
    outputs = {r["id"] for r in read_kind(output, "outputs", "rejects").to_pylist()}
    rejected = {i for i, r in quarantine.items() if r["reason"] == "degenerate"}
    assert rejected == both and not rejected & outputs
    assert all("after escalation to large" in quarantine[i]["detail"] for i in rejected)
    ledger = {r["id"]: r for r in read_kind(output, "ledger", "rejects").to_pylist()}
    assert all(
        ledger[i]["kind"] == "invalid_output"
        and ledger[i]["quarantined"]
        and ledger[i]["attempts"] == 2
        and ledger[i]["cost_usd"] > 0
        for i in rejected
    )
    assert not any(ledger[i]["degenerate"] or ledger[i]["acceptable"] is None for i in outputs)  # served: passes
    assert sum(m["acceptable"].values()) == sum(1 for r in ledger.values() if r["acceptable"]) > 0
    assert m["counts"]["quarantined"] == len(quarantine) and len(outputs) + len(quarantine) == m["counts"]["records"]


def test_labels_missing_a_score_or_the_file_are_one_line_errors(tmp_path):
    """A labelled set whose missing scores were written as NaN (Python's json.dumps of a missing float, pandas'
    `NaN`) trained and calibrated on them silently; a labels path that does not exist raised a traceback."""
    path = tmp_path / "l.jsonl"
    good = [{"text": f"item {i}", "quality": {"small": 0.5, "large": 0.9}} for i in range(12)]
    for missing in (float("nan"), float("inf")):
        rows = [*good[:3], {"text": "x", "quality": {"small": missing, "large": 0.9}}, *good[3:]]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        with pytest.raises(RouterError, match=r"l.jsonl:4: the quality scores must be finite numbers"):
            read_labels(path, "small", "large")
    with pytest.raises(RouterError, match=r"^labels .*nowhere.jsonl: No such file or directory$"):
        read_labels(tmp_path / "nowhere.jsonl", "small", "large")
