"""Structured output: a JSON schema enforced by vLLM's guided decoding, one retry, then quarantine."""

import pytest

from pipeline.config import ConfigError, load_config
from pipeline.generate.followup import final_output, next_attempt
from pipeline.keys import escalation_key, retry_key
from tests.conftest import TINY_CONFIG

SCHEMA = {
    "type": "object",
    "properties": {"summary": {"type": "string", "maxLength": 40}},
    "required": ["summary"],
    "additionalProperties": False,
}


def test_a_schema_that_is_not_a_json_schema_is_a_config_error():
    with pytest.raises(ConfigError, match="json_schema is not a valid JSON schema"):
        load_config(TINY_CONFIG, environ={"TOKENMILL_SAMPLING__JSON_SCHEMA": '{"type": "objekt"}'})


def test_invalid_outputs_are_retried_first_then_valid_ones_escalate(make_config):
    config = make_config(routing=True, sampling__json_schema=SCHEMA, route__escalation__min_mean_logprob=-3.0)
    good = {"tier": "small", "summary": '{"summary":"ok"}', "mean_logprob": -1.0, "finish_reason": "stop"}
    cut = {**good, "summary": '{"summary":"o', "finish_reason": "length"}
    extra_field = {**good, "summary": '{"summary":"ok","x":1}'}

    assert next_attempt("k", {"k": good}, config) is None
    key, changes = next_attempt("k", {"k": cut}, config)
    assert key == retry_key("k") and changes["max_tokens"] == 2 * config.sampling.max_tokens
    assert next_attempt("k", {"k": extra_field}, config)[0] == retry_key("k"), "schema violations count too"

    out = final_output("k", {"k": cut, retry_key("k"): good}, config)
    assert out.item is good and out.problem is None and out.retried and out.attempts == 2
    out = final_output("k", {"k": cut, retry_key("k"): cut}, config)
    assert "cut off by max_tokens" in out.problem and len(out.paid) == 2, "retried once, then it is a quarantine"
    assert next_attempt("k", {"k": cut, retry_key("k"): cut}, config) is None

    unsure = {**good, "mean_logprob": -5.0}
    esc = escalation_key("k", "large")
    assert next_attempt("k", {"k": cut, retry_key("k"): unsure}, config)[0] == esc, "a valid retry may escalate"
    large_bad = {**cut, "tier": "large"}
    out = final_output("k", {"k": unsure, esc: large_bad}, config)
    assert out.item is unsure and not out.escalated and len(out.paid) == 2, (
        "an invalid escalation keeps the valid first output"
    )
    assert out.attempts == 2, "and is still a paid attempt"
    cached = {**large_bad, "summary": '{"summary":"from the cache"}', "origin": "cache"}
    out = final_output("k", {"k": unsure, esc: cached}, config)
    assert out.escalated and len(out.paid) == 2 and out.attempts == 1, "an escalation the cache served is not paid here"


def test_a_record_whose_escalation_the_cache_served_pays_its_first_attempt_at_its_price(make_config):
    """Reproducer: the ledger row of a record generated here on the small tier whose escalation came from the
    reuse cache priced the small tier's GPU-seconds at the large tier's price (cost ≠ GPU-seconds × price)."""
    from datetime import datetime, timezone

    from pipeline.output.write import assemble_results

    config = make_config(routing=True, route__escalation__min_mean_logprob=-3.0)
    now = datetime.now(timezone.utc)
    first = unsure_on_small(now, id="r1", gpu_seconds=2.0)
    cached = {
        **first,
        "tier": "large",
        "summary": "sure",
        "mean_logprob": -1.0,
        "gpu_seconds": 0.0,
        "origin": "cache",
        "source_job": "earlier",
        "source_id": "r0",
        "saved_usd": 0.5,
    }
    records = one_record()
    outputs, ledger, _ = assemble_results(
        records, {"k": first, escalation_key("k", "large"): cached}, {}, config, "j", now
    )
    (row,) = ledger.to_pylist()
    assert outputs["summary"].to_pylist() == ["sure"] and row["escalated"] and row["attempts"] == 1
    small = config.tiers["small"].price_per_gpu_hour
    assert row["price_per_gpu_hour"] == small and row["cost_usd"] == pytest.approx(2.0 * small / 3600)
    assert (row["source"], row["source_id"], row["source_job"]) == ("cache_exact", "r0", "earlier"), (
        "the source names what made the served output: the cache"
    )


@pytest.mark.parametrize("quarantine", [[], ["degenerate"]])
def test_an_escalation_generated_here_for_a_record_the_cache_served_first_is_paid_by_that_record(
    make_config, quarantine
):
    """Reproducer: a record whose first attempt was a cache hit and whose escalation ran in this job got a ledger
    row costing nothing (and, quarantined by a check, no row at all): the escalation's GPU time was in no row."""
    from datetime import datetime, timezone

    from pipeline.generate.quality import compression_ratio
    from pipeline.output.write import assemble_results

    config = make_config(routing=True, route__escalation__min_mean_logprob=-3.0, checks__quarantine=quarantine)
    now = datetime.now(timezone.utc)
    first = unsure_on_small(
        now,
        id="r0",
        gpu_seconds=0.0,
        origin="cache",
        source_job="earlier",
        source_id="r0",
        saved_usd=0.25,
    )
    loop = "again " * 40
    escalation = {
        **first,
        "id": "r1",
        "tier": "large",
        "summary": loop,
        "compression_ratio": compression_ratio(loop),
        "mean_logprob": -1.0,
        "gpu_seconds": 2.0,
        "origin": None,
        "saved_usd": None,
        "cache_status": "miss",
    }
    records = one_record()
    outputs, ledger, quarantined = assemble_results(
        records, {"k": first, escalation_key("k", "large"): escalation}, {}, config, "j", now
    )
    (row,) = ledger.to_pylist()
    large = config.tiers["large"].price_per_gpu_hour
    assert row["cost_usd"] == pytest.approx(2.0 * large / 3600) and row["attempts"] == 1 and row["escalated"]
    assert row["saved_cost_usd"] == pytest.approx(0.25)  # what the cache saved, not the escalation paid here
    assert row["degenerate"] and not row["acceptable"]
    assert (outputs.num_rows, quarantined.num_rows) == ((0, 1) if quarantine else (1, 0))
    assert row["quarantined"] == bool(quarantine)
    assert (row["source"], row["source_id"], row["source_job"], row["cache_status"]) == (
        "generated",
        None,
        None,
        "miss",
    ), "the served output was generated here, not taken from the cache"


def one_record():
    """One staged record (id r1, item key k, on the small tier), as assemble_results reads it."""
    import pyarrow as pa

    return pa.table(
        {
            "id": ["r1"],
            "tenant": ["t"],
            "partition": ["p"],
            "reuse": pa.nulls(1, pa.string()),
            "similarity": pa.nulls(1, pa.float64()),
            "shadow": [False],
            "route_reason": ["default"],
            "item_key": ["k"],
            "gen_key": ["k"],
            "text": ["a document"],
            "scope": ["t=t"],
            "tier": ["small"],
            "file": ["f.jsonl"],
            "line": [1],
        }
    )


def unsure_on_small(now, **fields) -> dict:
    """A first attempt on the small tier below the escalation's confidence threshold (-5 against -3)."""
    return {
        "tenant": "t",
        "tier": "small",
        "model": "m",
        "summary": "unsure",
        "mean_logprob": -5.0,
        "finish_reason": "stop",
        "prompt_tokens": 10,
        "cached_prompt_tokens": 0,
        "output_tokens": 5,
        "baseline_gpu_seconds": 4.0,
        "created_at": now,
        **fields,
    }
