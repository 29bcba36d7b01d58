"""Structured output: a JSON schema enforced by vLLM's guided decoding, one retry, then quarantine."""

import json

import pyarrow.compute as pc
import pytest
from jsonschema import Draft202012Validator

from pipeline import run_job
from pipeline.config import ConfigError, load_config
from pipeline.dev.samples import write_sample_corpus
from pipeline.generate.followup import final_output, next_attempt
from pipeline.keys import escalation_key, retry_key
from tests.conftest import TINY_CONFIG, read_kind

SCHEMA = {"type": "object", "properties": {"summary": {"type": "string", "maxLength": 40}},
          "required": ["summary"], "additionalProperties": False}


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
    assert out.item is unsure and not out.escalated and len(out.paid) == 2, "an invalid escalation keeps the valid first output"
    assert out.attempts == 2, "and is still a paid attempt"


def test_a_job_with_a_json_schema_serves_valid_json_retries_once_and_quarantines_the_rest(make_config, tmp_path):
    write_sample_corpus(tmp_path / "input", documents=20, with_bad_input=False)
    # 24 tokens cuts some outputs off mid-string; the retry's 48 closes some of them, not all.
    config = make_config(sampling__json_schema=SCHEMA, sampling__max_tokens=24)
    manifest = run_job(config, job_id="js").manifest
    outputs, ledger, quarantine = (read_kind(tmp_path / "output", k, "js") for k in ("outputs", "ledger", "quarantine"))

    validator = Draft202012Validator(SCHEMA)
    for summary in outputs["summary"].to_pylist():
        assert validator.is_valid(json.loads(summary)), summary
    assert set(quarantine["reason"].to_pylist()) == {"invalid_output"}
    assert outputs.num_rows + quarantine.num_rows == manifest["counts"]["records"]
    assert not set(outputs["id"].to_pylist()) & set(quarantine["id"].to_pylist())

    served = ledger.filter(pc.invert(ledger["quarantined"]))
    paid_invalid = ledger.filter(ledger["quarantined"]).to_pylist()
    assert sorted(served["id"].to_pylist()) == sorted(outputs["id"].to_pylist())
    assert paid_invalid, "some outputs stay invalid after the retry"
    assert all(r["attempts"] == 2 and r["cost_usd"] > 0 and r["id"] in quarantine["id"].to_pylist() for r in paid_invalid)
    assert any(r["attempts"] == 2 for r in served.to_pylist()), "some retries succeed"
    details = dict(zip(quarantine["id"].to_pylist(), quarantine["detail"].to_pylist()))
    assert all("cut off by max_tokens" in details[r["id"]] for r in paid_invalid)

    # A rerun (a new job over the same input) pays nothing: first attempts and retries come from the cache.
    run_job(config, job_id="js2")
    again = read_kind(tmp_path / "output", "ledger", "js2")
    assert sum(again["cost_usd"].to_pylist()) == 0
    assert read_kind(tmp_path / "output", "quarantine", "js2").num_rows == quarantine.num_rows
