"""Batch request lines (ingest/batch.py) and their keys (keys.py): what runs, what is refused by name, and
what makes two requests the same."""

from __future__ import annotations

import json

import pytest

from pipeline.config import SamplingConfig
from pipeline.ingest.batch import RequestError, batch_format, messages_for, parse_request
from pipeline.keys import request_recipe_hash, request_sampling, request_scope


def line(**body):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the document"}]
    return {
        "custom_id": "r1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": messages, **body},
    }


def test_a_chat_request_becomes_a_record_with_its_document_apart():
    record = parse_request(line(max_tokens=50, temperature=0.5, stop="END", metadata={"tenant": "acme"}), "openai")
    assert record["id"] == "r1" and record["text"] == "the document" and record["tenant"] == "acme"
    request = json.loads(record["request"])
    assert request["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": None}]
    assert request["params"] == {"max_tokens": 50, "temperature": 0.5, "stop": ["END"]}
    assert messages_for(request, "another")[1] == {"role": "user", "content": "another"}


def test_the_format_is_told_by_the_line():
    assert batch_format(line()) == "openai"
    assert batch_format({"custom_id": "a", "params": {}}) == "anthropic"
    assert batch_format({"id": "d", "text": "x"}) is None


@pytest.mark.parametrize(
    "body, reason, named",
    [
        ({"n": 3}, "unsupported_request", "`n`"),
        ({"tools": [{"type": "function"}]}, "unsupported_request", "tools"),
        ({"logprobs": True}, "unsupported_request", "logprobs"),
        ({"stream": True}, "unsupported_request", "stream"),
        ({"frobnicate": 1}, "unsupported_request", "frobnicate"),
        ({"temperature": 9}, "invalid_request", "temperature"),
        ({"max_tokens": 0}, "invalid_request", "max_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "invalid_request", "stop"),
        ({"response_format": {"type": "grammar"}}, "unsupported_request", "response_format"),
        ({"model": None}, "invalid_request", "model"),
        ({"messages": []}, "invalid_request", "messages"),
        ({"messages": [{"role": "system", "content": "x"}]}, "invalid_request", "no user message"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "unsupported_request", "'tool'"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "unsupported_request",
            "image_url",
        ),
    ],
)
def test_what_a_request_asks_and_tokenmill_does_not_do_is_refused_by_name(body, reason, named):
    with pytest.raises(RequestError) as e:
        parse_request(line(**body), "openai")
    assert e.value.reason == reason and named in e.value.detail


def test_a_line_that_is_not_a_post_to_a_supported_endpoint_is_refused():
    with pytest.raises(RequestError, match="/v1/embeddings"):
        parse_request({**line(), "url": "/v1/embeddings"}, "openai")
    with pytest.raises(RequestError, match="GET"):
        parse_request({**line(), "method": "GET"}, "openai")
    with pytest.raises(RequestError) as e:
        parse_request({**line(), "custom_id": 7}, "openai")
    assert e.value.reason == "missing_id"


def test_an_anthropic_request_needs_max_tokens_and_takes_its_system_prompt_apart():
    params = {"model": "c", "max_tokens": 9, "system": "Sys.", "messages": [{"role": "user", "content": "doc"}]}
    request = json.loads(parse_request({"custom_id": "a", "params": params}, "anthropic")["request"])
    assert request["messages"][0] == {"role": "system", "content": "Sys."} and request["params"]["max_tokens"] == 9
    with pytest.raises(RequestError, match="max_tokens"):
        parse_request({"custom_id": "a", "params": {**params, "max_tokens": None}}, "anthropic")


def test_keys_depend_on_the_template_and_sampling_never_on_the_model_name():
    def request(**body):
        return parse_request(line(**body), "openai")["request"]

    base, sampling = request(), SamplingConfig()
    assert request_scope("t=a", base) == request_scope("t=a", request(model="other-name"))
    assert request_scope("t=a", base) != request_scope("t=a", request(temperature=0.3))
    assert request_scope("t=a", base).startswith("r=") and request_scope("t=a", base).endswith(":t=a")
    recipe = request_recipe_hash("model-path", base, sampling, None)
    assert recipe == request_recipe_hash("model-path", request(model="other-name"), sampling, None)
    assert recipe != request_recipe_hash("model-path", request(seed=4), sampling, None)
    assert recipe != request_recipe_hash("model-path", base, sampling, "adapter-digest")
    assert request_sampling(sampling, request(max_tokens=7, top_p=0.5)).max_tokens == 7
    assert request_sampling(sampling, None) is sampling
