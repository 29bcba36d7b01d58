"""Structured output: a JSON schema enforced by vLLM's guided decoding, one retry, then quarantine."""


import pytest

from pipeline.config import ConfigError, load_config
from pipeline.generate.followup import final_output, next_attempt
from pipeline.keys import escalation_key, retry_key
from tests.conftest import TINY_CONFIG

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
    cached = {**large_bad, "summary": '{"summary":"from the cache"}', "origin": "cache"}
    out = final_output("k", {"k": unsure, esc: cached}, config)
    assert out.escalated and len(out.paid) == 2 and out.attempts == 1, "an escalation the cache served is not paid here"


