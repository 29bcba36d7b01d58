"""`tokenmill serve` as the official SDKs see it: every object, list page, error and result line the server
answers validates against the `openai` and `anthropic` packages' own pydantic models in strict mode; usage
counts the attempt that answered; OpenAI's error semantics and validation; Anthropic's Message Batches API;
no server path in anything a tenant reads. One server for the module (every answer escalated to `large`)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import anthropic
import httpx
import httpx2
import openai
import pytest
from anthropic.types import ErrorResponse
from anthropic.types.messages import MessageBatch, MessageBatchIndividualResponse
from openai.types import Batch, BatchError, Completion, FileDeleted, FileObject, Model
from openai.types.chat import ChatCompletion
from openai.types.shared import ErrorObject

from pipeline.serve.access import key_digest
from tests.conftest import read_kind
from tests.integration.test_batch_files import DOC, OTHER, chat
from tests.system.test_batch_api import DEADLINE, KEYS, Server, batch_file, lines_of, wait_for

SEEN: list[tuple[str, str, int, str]] = []  # every response of the module's SDK calls: method, path, status, body


def record(response) -> None:
    response.read()
    SEEN.append((response.request.method, response.request.url.path, response.status_code, response.text))


@pytest.fixture(scope="module")
def server(make_config_module, tmp_path_factory):
    tenants = {f"tenants__{name}": {"api_keys": [key_digest(key)]} for name, key in KEYS.items()}
    config = make_config_module(
        tiers__small__served_model_names=["gpt-4o-mini"],
        dedup__shadow_rate=0,
        route__escalation__enabled=True,
        route__escalation__min_mean_logprob=0.0,  # every answer of `small` is escalated: two attempts each
        route__escalation__to_tier="large",
        **tenants,
    )
    with Server(config, tmp_path_factory.mktemp("serve")) as s:
        yield s


def openai_client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", **recorded())


def anthropic_client(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", **recorded())


def recorded() -> dict:
    """An SDK client's arguments: acme's key, no retries, every response recorded in SEEN."""
    http = httpx2.Client(event_hooks={"response": [record]}, timeout=30)
    return {"api_key": KEYS["acme"], "max_retries": 0, "http_client": http}


def test_the_openai_sdk_reads_a_batch_whose_usage_counts_the_answering_attempt(server, tmp_path):
    client = openai_client(server)
    assert {m.id for m in client.models.list()} == {"gpt-4o-mini", "small", "large"}
    assert client.models.retrieve("gpt-4o-mini").owned_by == "tokenmill"
    lines = [chat("a", DOC), chat("b", OTHER), chat("c", OTHER, model="no-such-model"), chat("d", DOC)]
    uploaded = client.files.create(
        file=batch_file(tmp_path, lines).open("rb"),
        purpose="batch",
        expires_after={"anchor": "created_at", "seconds": 3600},
    )
    assert uploaded.expires_at == uploaded.created_at + 3600
    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        output_expires_after={"anchor": "created_at", "seconds": 7200},
    )
    done = wait_for(client, batch.id, ("completed", "failed"))
    assert done.status == "completed", done.errors
    assert done.model == "large"  # what answered: the escalation tier, by the name it serves under
    output, errors = lines_of(client, done.output_file_id), lines_of(client, done.error_file_id)
    by_id = {line["custom_id"]: line for line in output}
    ledger = {r["id"]: r for r in read_kind(Path(server.runner.config.output.uri), "ledger", batch.id).to_pylist()}
    for custom_id in ("a", "b"):  # the draft and the escalation paid; the client sees the answer's usage
        usage, extension = by_id[custom_id]["response"]["body"]["usage"], by_id[custom_id]["tokenmill"]
        assert usage["completion_tokens"] == 24 and ledger[custom_id]["output_tokens"] == 48
        assert extension["attempts"] == 2 and extension["escalated"] is True and extension["cost_usd"] > 0
    assert by_id["d"]["response"]["body"]["usage"]["total_tokens"] == 0
    assert by_id["d"]["tokenmill"]["source"] == "duplicate_in_job"
    assert done.usage.output_tokens == 48 and done.usage.total_tokens == done.usage.input_tokens + 48
    (refused,) = errors  # an HTTP-style failure: its error object in the body, top-level `error` null
    assert refused["custom_id"] == "c" and refused["error"] is None and refused["response"]["status_code"] == 400
    error = refused["response"]["body"]["error"]
    assert error["code"] == "unknown_model" and error["message"].endswith("(served: gpt-4o-mini, large, small)")
    outputs = client.files.list(purpose="batch_output", order="asc")
    assert [f.id for f in outputs.data] == [done.output_file_id, done.error_file_id]
    assert all(f.expires_at == f.created_at + 7200 for f in outputs.data)
    first = client.files.list(limit=1)
    assert first.has_more and first.first_id == first.last_id == done.error_file_id  # newest first
    assert client.files.list(limit=1, after=first.last_id).data[0].id == done.output_file_id


def test_a_file_openai_refuses_fails_the_batch_at_validating_naming_each_line(server, tmp_path):
    client = openai_client(server)
    lines = [chat("a", DOC), '{"custom_id": "broken", "body": ', {**chat("b", DOC), "url": "/v1/completions"}]
    lines.append(chat("a", OTHER))
    uploaded = client.files.create(file=batch_file(tmp_path, lines).open("rb"), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    failed = wait_for(client, batch.id, ("failed", "completed"))
    assert failed.status == "failed" and failed.output_file_id is None
    assert [(e.code, e.line, e.param) for e in failed.errors.data] == [
        ("invalid_json_line", 2, None),
        ("url_mismatch", 3, "url"),
        ("duplicate_custom_id", 4, "custom_id"),
    ]


def test_the_anthropic_sdk_runs_cancels_and_streams_message_batches(server):
    client = anthropic_client(server)
    ask = {"model": "gpt-4o-mini", "max_tokens": 24, "messages": [{"role": "user", "content": f"Summarize: {OTHER}"}]}
    created = client.messages.batches.create(
        requests=[{"custom_id": "ok", "params": ask}, {"custom_id": "bad", "params": {**ask, "model": "nope"}}]
    )
    assert created.processing_status == "in_progress" and created.request_counts.processing == 2
    queued = client.messages.batches.create(requests=[{"custom_id": "q1", "params": ask}])
    assert client.messages.batches.cancel(queued.id).processing_status == "canceling"
    ended = wait_ended(client, created.id)
    assert ended.request_counts.succeeded == 1 and ended.request_counts.errored == 1 and ended.ended_at
    results = {r.custom_id: r.result for r in client.messages.batches.results(created.id)}
    assert results["ok"].type == "succeeded" and results["ok"].message.usage.output_tokens == 24
    assert results["bad"].type == "errored" and results["bad"].error.error.type == "invalid_request_error"
    cancelled = wait_ended(client, queued.id)
    assert cancelled.request_counts.canceled == 1 and cancelled.cancel_initiated_at is not None
    assert [r.result.type for r in client.messages.batches.results(queued.id)] == ["canceled"]
    page = client.messages.batches.list(limit=1)
    assert [b.id for b in page.data] == [queued.id] and page.has_more and page.last_id == queued.id
    # Anthropic's own headers: the key as `x-api-key`; `anthropic-version` required.
    url = f"http://127.0.0.1:{server.port}/v1/messages/batches/{created.id}"
    with httpx.Client(event_hooks={"response": [record]}) as http:
        assert http.get(url, headers={"x-api-key": KEYS["acme"], "anthropic-version": "2023-06-01"}).status_code == 200
        missing = http.get(url, headers={"x-api-key": KEYS["acme"]})
        assert missing.status_code == 400 and missing.json()["error"]["type"] == "invalid_request_error"
        other = {"x-api-key": KEYS["globex"], "anthropic-version": "2023-06-01"}
        assert http.get(url, headers=other).json()["error"]["type"] == "not_found_error"


def wait_ended(client: anthropic.Anthropic, batch_id: str):
    started = time.monotonic()
    while time.monotonic() - started < DEADLINE:
        batch = client.messages.batches.retrieve(batch_id)
        if batch.processing_status == "ended":
            return batch
        time.sleep(0.5)
    raise AssertionError(f"message batch {batch_id} still {batch.processing_status} after {DEADLINE} s")


def test_every_framework_error_is_an_openai_error_object(server):
    url = f"http://127.0.0.1:{server.port}/v1"
    key = {"Authorization": f"Bearer {KEYS['acme']}"}
    with httpx.Client(event_hooks={"response": [record]}) as http:
        answers = {
            404: http.get(f"{url}/no/such/route", headers=key),
            405: http.delete(f"{url}/batches", headers=key),
            413: http.post(f"{url}/batches", headers=key, content=b" " * (2 << 20)),
            400: http.post(f"{url}/batches", headers=key, json={"input_file_id": 1, "endpoint": [], "x": 0}),
            401: http.get(f"{url}/files"),
        }
        assert http.post(f"{url}/files", headers=key, files={"file": b"{}"}, data={"purpose": "fine-tune"}).is_error
    for status, answer in answers.items():
        assert answer.status_code == status, answer.text
        ErrorObject.model_validate_json(json.dumps(answer.json()["error"]), strict=True)


def test_expired_files_are_deleted(server, tmp_path):
    client = openai_client(server)
    uploaded = client.files.create(
        file=batch_file(tmp_path, [chat("x", DOC)]).open("rb"),
        purpose="batch",
        expires_after={"anchor": "created_at", "seconds": 3600},
    )
    kept = client.files.create(file=batch_file(tmp_path, [chat("y", DOC)], "kept.jsonl").open("rb"), purpose="batch")
    content = Path(server.runner.config.output.uri, "_api", "files", f"{uploaded.id}.jsonl")
    assert content.exists()
    real = server.store.clock
    server.store.clock = lambda: real() + 3600
    try:
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(uploaded.id)
        listed = {f.id for f in client.files.list()}
        assert kept.id in listed and uploaded.id not in listed and not content.exists()
    finally:
        server.store.clock = real
    with pytest.raises(openai.BadRequestError, match="expires_after.seconds"):
        short = {"anchor": "created_at", "seconds": 60}
        client.files.create(
            file=batch_file(tmp_path, [chat("z", DOC)]).open("rb"), purpose="batch", expires_after=short
        )


OPENAI_OBJECTS = [  # (method, path pattern, the model of the object it answers)
    ("POST", r"/v1/files", FileObject),
    ("GET", r"/v1/files/file-\w+", FileObject),
    ("DELETE", r"/v1/files/file-\w+", FileDeleted),
    ("POST", r"/v1/batches(/batch-\w+/cancel)?", Batch),
    ("GET", r"/v1/batches/batch-\w+", Batch),
    ("GET", r"/v1/models/.+", Model),
    ("POST", r"/v1/messages/batches", MessageBatch),
    ("POST|GET", r"/v1/messages/batches/batch-\w+(/cancel)?", MessageBatch),
]
PAGES = [("GET", r"/v1/files", FileObject), ("GET", r"/v1/batches", Batch), ("GET", r"/v1/models", Model)]


def test_every_answer_validates_strictly_and_names_no_server_path(server, tmp_path_factory):
    """Last in the module: every response its SDK calls got, checked against the SDKs' models (JSON mode,
    strict), and scanned for the test's folders (models, output root, state) in any text a tenant reads."""
    assert len(SEEN) > 40
    secrets = {str(tmp_path_factory.getbasetemp()), str(Path(server.runner.config.output.uri).parent)}
    for method, path, status, text in SEEN:
        assert not any(s in text for s in secrets), (method, path, text)
        if status >= 400:
            body = json.loads(text)
            if path.startswith("/v1/messages/"):
                ErrorResponse.model_validate_json(text, strict=True)
            else:
                ErrorObject.model_validate_json(json.dumps(body["error"]), strict=True)
        elif path.endswith("/content") or path.endswith("/results"):
            for line in text.splitlines():
                result_line(path, line)
        else:
            validate(method, path, text)


def validate(method: str, path: str, text: str) -> None:
    for methods, pattern, model in OPENAI_OBJECTS:
        if re.fullmatch(methods, method) and re.fullmatch(pattern, path):
            model.model_validate_json(text, strict=True)
            return
    page = json.loads(text)
    model = MessageBatch if path == "/v1/messages/batches" else next(m for _, p, m in PAGES if p == path)
    for item in page["data"]:
        model.model_validate_json(json.dumps(item), strict=True)
    assert isinstance(page["has_more"], bool) if path != "/v1/models" else page["object"] == "list"
    if path != "/v1/models":
        assert page["first_id"] == (page["data"][0]["id"] if page["data"] else None)
        assert page["last_id"] == (page["data"][-1]["id"] if page["data"] else None)


def result_line(path: str, line: str) -> None:
    """A line of a file the SDK downloaded: an input line (not ours to check), an output, error or result line."""
    value = json.loads(line)
    if path.endswith("/results"):
        MessageBatchIndividualResponse.model_validate_json(line, strict=True)
    elif "response" in value:
        response = value["response"]
        if response is None:  # a request a stopped batch never ran
            BatchError.model_validate_json(json.dumps(value["error"]), strict=True)
        elif response["status_code"] == 200:
            body = response["body"]
            (ChatCompletion if body["object"] == "chat.completion" else Completion).model_validate_json(
                json.dumps(body), strict=True
            )
        else:
            assert value["error"] is None
            ErrorObject.model_validate_json(json.dumps(response["body"]["error"]), strict=True)
