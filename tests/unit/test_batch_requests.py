"""Batch request lines (ingest/batch.py) and their keys (keys.py): what runs, what is refused by name, and
what makes two requests the same."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from pipeline.config import SamplingConfig
from pipeline.ingest.batch import RequestError, batch_format, messages_for, parse_request
from pipeline.keys import request_recipe_hash, request_sampling, request_scope
from pipeline.schema import REQUEST


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
    request = record["request"]
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
    request = parse_request({"custom_id": "a", "params": params}, "anthropic")["request"]
    assert request["messages"][0] == {"role": "system", "content": "Sys."} and request["params"]["max_tokens"] == 9
    with pytest.raises(RequestError, match="max_tokens"):
        parse_request({"custom_id": "a", "params": {**params, "max_tokens": None}}, "anthropic")


def test_keys_depend_on_the_template_and_sampling_never_on_the_model_name():
    def request(**body):
        return parse_request(line(**body), "openai")["request"]

    base, sampling = request(), SamplingConfig()
    scope = request_scope("t=a", base, sampling)
    assert scope == request_scope("t=a", request(model="other-name"), sampling)
    assert scope == request_scope("t=a", request(temperature=0.0), sampling)  # the effective value is the default's
    assert scope != request_scope("t=a", request(temperature=0.3), sampling)
    assert scope.startswith("r=") and scope.endswith(":t=a")
    recipe = request_recipe_hash("model-path", base, sampling, None)
    assert recipe == request_recipe_hash("model-path", request(model="other-name"), sampling, None)
    assert recipe != request_recipe_hash("model-path", request(seed=4), sampling, None)
    assert recipe != request_recipe_hash("model-path", base, sampling, "adapter-digest")
    assert request_sampling(sampling, request(max_tokens=7, top_p=0.5)).max_tokens == 7
    assert request_sampling(sampling, None) is sampling
    # The config's output schema and stop strings are for documents: a request gets them only when it asks.
    strict = SamplingConfig(json_schema={"type": "object"}, stop=["END"])
    assert request_sampling(strict, base).json_schema is None and request_sampling(strict, base).stop == []
    asked = request(response_format={"type": "json_object"})
    assert request_sampling(strict, asked).json_schema == {"type": "object"}


def test_a_request_is_read_as_a_typed_column_and_keys_as_it_did_as_json_text():
    """Parsed once as the line is read (schema.REQUEST): the column a step reads gives the same sampling and
    keys as the parsed request, and the keys a request had when it was staged as JSON text."""
    asked = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}
    schema = {"type": "json_schema", "json_schema": {"schema": asked}}
    parsed = parse_request(line(max_tokens=50, temperature=0.5, stop="END", response_format=schema), "openai")
    column = pa.array([parsed["request"], None], REQUEST)
    typed, sampling = column[0].as_py(), SamplingConfig()
    assert column[1].as_py() is None and typed["messages"][1] == {"role": "user", "content": None}
    assert request_sampling(sampling, typed) == request_sampling(sampling, parsed["request"])
    assert request_sampling(sampling, typed).json_schema == asked
    assert request_sampling(sampling, typed).max_tokens == 50 and request_sampling(sampling, typed).seed == 0
    # the recipe as tokenmill 0.1.0 computed it from the request's canonical JSON text
    assert request_recipe_hash("model-path", typed, sampling, None) == "1c86d6206c45c94f"


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": ["user"], "content": "x"}]},
        {"temperature": 10**400},
        {"response_format": {"type": "json_schema", "json_schema": "x"}},
        {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "Sure"}]},
        {"seed": 2**70},
    ],
)
def test_a_hostile_request_line_is_a_quarantine_row_never_a_traceback(body, tmp_path):
    """Each of these once escaped the parser's checks (a list as a role, a 400-digit number, a string where
    an object belongs); the reader quarantines the line and reads on."""
    from pipeline.config import InputConfig
    from pipeline.ingest.read import FileReader
    from pipeline.stores import storage

    nested = {**line(), "body": {**line()["body"], "metadata": {"deep": json.loads("[" * 150 + "]" * 150)}}}
    lines = [line(**body), nested, line()]
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    table = FileReader(storage.resolve(str(tmp_path)), "b.jsonl", str(tmp_path / "b.jsonl"), InputConfig()).table()
    errors = table["read_error"].to_pylist()
    assert errors[0] in ("invalid_request", "unsupported_request") and errors[1] == "too_deeply_nested"
    assert errors[2] is None and table["request"][2].as_py() is not None


def test_a_request_its_models_chat_template_refuses_is_refused_alone():
    from pipeline.config import PromptConfig
    from pipeline.generate.requests import render_rows

    class Template:
        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            if [m["role"] for m in messages][:2] == ["user", "assistant"] and len(messages) > 2:
                raise ValueError("Conversation roles must alternate user/assistant/user/assistant")
            return "|".join(m["content"] for m in messages)

    turns = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "d"},
    ]
    fine = parse_request(line(), "openai")["request"]
    refused = parse_request(line(messages=turns), "openai")["request"]
    out, why = render_rows(Template(), ["doc a", "doc b"], [fine, refused], PromptConfig())
    assert out[0] == "Be brief.|doc a" and out[1] is None
    assert "alternate" in why[1] and 0 not in why


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_request_whose_max_tokens_no_integer_column_holds_is_quarantined_alone(field, tmp_path):
    """2**63 is past int64: the line once failed its whole file when the request column was built."""
    from pipeline.config import InputConfig
    from pipeline.ingest.read import FileReader
    from pipeline.stores import storage

    lines = [line(max_tokens=50), {**line(**{field: 2**63}), "custom_id": "big"}, {**line(), "custom_id": "r3"}]
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    table = FileReader(storage.resolve(str(tmp_path)), "b.jsonl", str(tmp_path / "b.jsonl"), InputConfig()).table()
    assert table["read_error"].to_pylist() == [None, "invalid_request", None]
    assert field in table["read_detail"][1].as_py() and table["id"][1].as_py() == "big"
    assert table["request"][0].as_py()["params"]["max_tokens"] == 50 and table["id"][2].as_py() == "r3"


def test_a_value_no_column_holds_is_quarantined_by_the_reader_alone_naming_its_field(tmp_path, monkeypatch):
    """The net under the parser's checks: a request the parser let through whose integer Arrow cannot hold."""
    from pipeline.config import InputConfig
    from pipeline.ingest import read
    from pipeline.stores import storage

    def lenient(obj, fmt):
        record = parse_request(obj, fmt)
        if record["id"] == "r1":
            record["request"]["params"]["seed"] = 2**64
        return record

    monkeypatch.setattr(read, "parse_request", lenient)
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(x) + "\n" for x in [line(), {**line(), "custom_id": "r2"}]))
    table = read.FileReader(storage.resolve(str(tmp_path)), "b.jsonl", str(tmp_path / "b.jsonl"), InputConfig()).table()
    assert table["read_error"].to_pylist() == ["invalid_request", None]
    assert "seed" in table["read_detail"][0].as_py() and table["request"][0].as_py() is None
