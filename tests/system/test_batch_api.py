"""`tokenmill serve` (pipeline/serve/): the official `openai` SDK against the Batch API on 127.0.0.1, each batch
a tokenmill job run by the server's runner in a child process on the fake tiers."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

import httpx
import httpx2
import openai
import pyarrow.parquet as pq
import pytest
import uvicorn

from pipeline.serve.access import key_digest
from pipeline.serve.app import create_app
from pipeline.serve.listen import uvicorn_config
from pipeline.serve.runner import BatchRunner
from pipeline.serve.store import ApiStore
from pipeline.stores import storage
from tests.conftest import read_kind
from tests.integration.test_batch_files import DOC, OTHER, batch_lines, chat
from tests.jobs import assert_exactly_once

KEYS = {"acme": "tm-acme-secret", "globex": "tm-globex-secret"}
DEADLINE = 240  # seconds a batch may take to reach the state a test waits for (it gets there by itself)


class Server:
    """The API and its runner, as `tokenmill serve` wires them, on a free local port."""

    def __init__(self, config, workdir: Path):
        self.store = ApiStore(storage.resolve(config.output.uri))
        self.runner = BatchRunner(config, self.store, workdir)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        app = create_app(config, self.store, self.runner)  # its lifespan starts and closes the runner
        self.server = uvicorn.Server(uvicorn_config(app, config.serve, "127.0.0.1", self.port, "warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        # The test's folders (output root, state, the models under $TOKENMILL_HOME): no answer may name them.
        self.folders = {str(Path(config.output.uri).parent), str(workdir), os.environ["TOKENMILL_HOME"]}
        self.answers: list[str] = []  # every response body its clients got

    def __enter__(self):
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        return self

    def __exit__(self, failed, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=40)  # the runner closes as the app's lifespan ends
        if failed is None:  # no error message, result line or object a tenant read names a server path
            leaks = [a for a in self.answers if any(folder in a for folder in self.folders)]
            assert not leaks, leaks[:3]

    def client(self, tenant: str | None = "acme", key: str | None = None) -> openai.OpenAI:
        http = httpx2.Client(event_hooks={"response": [self.keep]}, timeout=30)
        return openai.OpenAI(
            api_key=key or KEYS[tenant], base_url=f"http://127.0.0.1:{self.port}/v1", max_retries=0, http_client=http
        )

    def keep(self, response) -> None:
        self.answers.append(response.read().decode(errors="replace"))


@pytest.fixture
def config_for(make_config):
    def make(**overrides):
        tenants = {f"tenants__{name}": {"api_keys": [key_digest(key)]} for name, key in KEYS.items()}
        return make_config(
            tiers__small__served_model_names=["gpt-4o-mini"], dedup__shadow_rate=0, **tenants, **overrides
        )

    return make


def batch_file(tmp_path: Path, lines: list, name: str = "batch.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def submit(client: openai.OpenAI, path: Path):
    uploaded = client.files.create(file=path.open("rb"), purpose="batch")
    return client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"night": "1"}
    )


def wait_for(client: openai.OpenAI, batch_id: str, statuses: tuple[str, ...]):
    started = time.monotonic()
    while time.monotonic() - started < DEADLINE:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        time.sleep(0.5)
    raise AssertionError(f"batch {batch_id} still {batch.status} after {DEADLINE} s")


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()] if file_id else []


def every_request_once(server: Server, batch_id: str, lines: list[dict]):
    """Every request of the batch in one output or quarantine row, every paid generation and engine-second in
    its ledger exactly once (tests/jobs.py); returns the outputs."""
    ids = [line["custom_id"] for line in lines]
    state_db = server.runner.config.state.url.removeprefix("sqlite:///")
    return assert_exactly_once(
        Path(server.runner.config.output.uri), batch_id, {"ids": ids, "bad_records": 0}, state_db
    )


def test_the_openai_sdk_runs_a_batch_and_the_same_file_again_costs_nothing(config_for, tmp_path):
    config = config_for(serve__validation="lenient")  # lines OpenAI refuses at `validating` become error lines
    with Server(config, tmp_path / "serve") as server:
        client = server.client()
        batch = submit(client, batch_file(tmp_path, batch_lines()))
        assert batch.status == "validating" and batch.metadata == {"night": "1"}
        done = wait_for(client, batch.id, ("completed", "failed"))
        assert done.status == "completed", done.errors
        output, errors = lines_of(client, done.output_file_id), lines_of(client, done.error_file_id)
        assert len(output) + len(errors) == len(batch_lines())  # one line per request
        assert done.request_counts.total == 13 and done.request_counts.completed == len(output) == 6
        assert {e["custom_id"] for e in errors} >= {"r8", "r9", "r10", "r11"} and None in {
            e["custom_id"] for e in errors
        }
        # The answers are the job's Parquet outputs, and the batch says what it paid.
        rows = {r["id"]: r["summary"] for r in pq.read_table(Path(config.output.uri) / "outputs").to_pylist()}
        for line in output:
            choice = line["response"]["body"]["choices"][0]
            assert (choice.get("message") or {}).get("content", choice.get("text")) == rows[line["custom_id"]]
        paid = done.model_extra["tokenmill"]["cost_usd"]
        assert paid > 0

        again = wait_for(client, submit(client, batch_file(tmp_path, batch_lines())).id, ("completed", "failed"))
        assert again.status == "completed" and again.model_extra["tokenmill"]["cost_usd"] == 0
        assert [line["response"]["body"]["choices"] for line in lines_of(client, again.output_file_id)] == [
            line["response"]["body"]["choices"] for line in output
        ]
        assert [b.id for b in client.batches.list().data] == [again.id, batch.id]  # newest first


def test_a_key_sees_and_touches_only_its_own_tenants_objects(config_for, tmp_path):
    with Server(config_for(serve__max_file_bytes=65536), tmp_path / "serve") as server:
        acme, globex = server.client("acme"), server.client("globex")
        uploaded = acme.files.create(file=batch_file(tmp_path, [chat("a", DOC)]).open("rb"), purpose="batch")
        batch = acme.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
        assert globex.files.list().data == [] and globex.batches.list().data == []
        for call in (
            lambda: globex.files.retrieve(uploaded.id),
            lambda: globex.files.content(uploaded.id),
            lambda: globex.files.delete(uploaded.id),
            lambda: globex.batches.retrieve(batch.id),
            lambda: globex.batches.cancel(batch.id),
            lambda: globex.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
            ),
        ):
            with pytest.raises(openai.NotFoundError):
                call()
        with pytest.raises(openai.AuthenticationError):
            server.client(key="tm-not-a-key").files.list()
        # An id is never a path: the store refuses one that names another object's file.
        assert server.store.file("acme", "file-../../_api/batches/x") is None
        assert server.store.batch(None, "batch-../files/x") is None
        # The key is checked before any body is read, and a body is capped as it streams in (chunked: no length).
        url = f"http://127.0.0.1:{server.port}/v1"
        assert httpx.post(f"{url}/batches", content=b"{" * (4 << 20)).status_code == 401
        acme_key = {"Authorization": f"Bearer {KEYS['acme']}", "Content-Type": "multipart/form-data; boundary=b"}

        def chunked():  # a well-formed upload of 512 KiB, over the 64 KiB cap
            yield b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n'
            for _ in range(64):
                yield b"x" * 8192
            yield b"\r\n--b--\r\n"

        assert httpx.post(f"{url}/files", headers=acme_key, content=chunked()).status_code == 413
        with pytest.raises(openai.BadRequestError, match="completion_window"):
            acme.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="1h")
        with pytest.raises(openai.BadRequestError, match="endpoint"):
            acme.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
        done = wait_for(acme, batch.id, ("completed", "failed"))
        assert done.status == "completed" and done.request_counts.completed == 1
        with pytest.raises(openai.NotFoundError):
            globex.files.content(done.output_file_id)
        assert acme.files.delete(uploaded.id).deleted
        with pytest.raises(openai.NotFoundError):
            acme.files.content(uploaded.id)


def stalled_batch(server: Server, tmp_path: Path, stall: int):
    """A batch whose job froze once `stall` requests finished (the fake engine's `stall_after`): the moment
    a cancel or a restart finds work paid for and work in flight. Waits until those items are stored."""
    from sqlalchemy import text

    from pipeline.stores.catalog import StateStore

    client = server.client()
    lines = [chat(f"s{i}", f"{OTHER} Item number {i} of the night.") for i in range(8)]
    batch = submit(client, batch_file(tmp_path, lines, "stall.jsonl"))
    wait_for(client, batch.id, ("in_progress",))
    state = StateStore(server.runner.config.state.url)

    def stored() -> int:
        with state.engine.connect() as c:
            return c.execute(text("SELECT count(*) FROM items WHERE job_id = :j"), {"j": batch.id}).scalar()

    started = time.monotonic()
    while stored() < stall and time.monotonic() - started < DEADLINE:
        time.sleep(0.5)
    assert stored() == stall
    return client, batch, lines


def test_cancel_mid_run_keeps_what_was_paid_for(config_for, tmp_path):
    config = config_for(tiers__small__fake__stall_after=3)
    with Server(config, tmp_path / "serve") as server:
        client, batch, lines = stalled_batch(server, tmp_path, 3)
        # A batch queued behind it is cancelled where it stands, without running.
        queued = submit(client, batch_file(tmp_path, [chat("q", DOC)], "queued.jsonl"))
        client.batches.cancel(queued.id)
        ended = wait_for(client, queued.id, ("cancelled",))
        assert ended.output_file_id is None and ended.request_counts.completed == 0
        assert client.batches.cancel(batch.id).status == "cancelling"
        cancelled = wait_for(client, batch.id, ("cancelled",))
        assert cancelled.cancelling_at and cancelled.cancelled_at
        # The three answers paid for before the cancel are returned; the other requests were never run.
        output, errors = lines_of(client, cancelled.output_file_id), lines_of(client, cancelled.error_file_id)
        assert len(output) == cancelled.request_counts.completed == 3
        assert all(line["tokenmill"]["source"] == "generated" for line in output)
        assert len(errors) == cancelled.request_counts.failed == len(lines) - 3
        assert all(e["response"] is None and e["error"]["code"] == "batch_cancelled" for e in errors)
        assert sorted(line["custom_id"] for line in output + errors) == sorted(line["custom_id"] for line in lines)
        answered = every_request_once(server, batch.id, lines)
        assert sorted(answered["id"].to_pylist()) == sorted(line["custom_id"] for line in output)
    # What the cancelled batch paid for is not paid again: submitted anew, three answers come from the cache.
    with Server(config_for(), tmp_path / "serve2") as server:
        client = server.client()
        done = wait_for(client, submit(client, batch_file(tmp_path, lines, "again.jsonl")).id, ("completed",))
        sources = [line["tokenmill"]["source"] for line in lines_of(client, done.output_file_id)]
        assert sources.count("cache_exact") == 3 and sources.count("generated") == len(lines) - 3


def test_a_restarted_server_resumes_its_batch_and_pays_nothing_twice(config_for, tmp_path):
    with Server(config_for(tiers__small__fake__stall_after=3), tmp_path / "serve") as server:
        client, batch, lines = stalled_batch(server, tmp_path, 3)
    # The server stopped mid-batch (its job killed); started again, it runs the same job to its end.
    with Server(config_for(), tmp_path / "serve") as server:
        client = server.client()
        done = wait_for(client, batch.id, ("completed",))
        output = lines_of(client, done.output_file_id)
        assert sorted(line["custom_id"] for line in output) == sorted(line["custom_id"] for line in lines)
        sources = [line["tokenmill"]["source"] for line in output]
        assert sources.count("generated") == len(lines)  # the three paid before the restart are not paid again
        ledger = read_kind(Path(server.runner.config.output.uri), "ledger", batch.id).to_pylist()
        generated = [r for r in ledger if r["kind"] == "output" and r["source"] == "generated"]
        assert len(generated) == len({r["id"] for r in generated}) == len(lines)
        assert all(r["attempts"] == 1 for r in generated)


def test_a_job_refused_at_a_cap_after_paying_for_some_returns_what_it_paid_for(config_for, tmp_path):
    """A batch whose job paid for three answers, then (its server restarted under a lower cap) is refused when it
    starts again: the three answers are returned, the other requests are `budget_exceeded` errors."""
    with Server(config_for(tiers__small__fake__stall_after=3), tmp_path / "serve") as server:
        client, batch, lines = stalled_batch(server, tmp_path, 3)
    with Server(config_for(budget__default_tenant_usd=1e-9), tmp_path / "serve") as server:
        client = server.client()
        done = wait_for(client, batch.id, ("completed", "failed"))
        assert done.status == "completed" and done.errors.data[0].code == "budget_exceeded"
        output, errors = lines_of(client, done.output_file_id), lines_of(client, done.error_file_id)
        assert len(output) == done.request_counts.completed == 3
        assert len(errors) == done.request_counts.failed == len(lines) - 3
        assert {e["response"]["body"]["error"]["code"] for e in errors} == {"budget_exceeded"}
        every_request_once(server, batch.id, lines)


def test_a_batch_over_its_tenants_budget_is_refused_when_created_and_the_same_file_again_is_not(config_for, tmp_path):
    """With budget caps, `POST /v1/batches` estimates the batch's job and refuses one that would cross its tenant's
    cap, with the estimate, before the batch exists. Exact cache hits count as free: the file paid for once
    is created under the same cap and completes at $0."""
    lines = batch_lines()
    lenient = {"serve__validation": "lenient"}
    with Server(config_for(**lenient), tmp_path / "serve") as server:  # no cap: the file is paid for once
        client = server.client()
        first = wait_for(client, submit(client, batch_file(tmp_path, lines)).id, ("completed", "failed"))
        assert first.status == "completed" and first.model_extra["tokenmill"]["cost_usd"] > 0
    with Server(config_for(budget__default_tenant_usd=1e-9, **lenient), tmp_path / "serve") as server:
        client = server.client()
        new = [chat(f"n{i}", f"{OTHER} Entry {i} of the bakery's register.") for i in range(3)]
        with pytest.raises(openai.BadRequestError) as refused:
            submit(client, batch_file(tmp_path, new, "new.jsonl"))
        error = refused.value.body
        assert error["code"] == "budget_exceeded" and "estimated" in error["message"] and "acme" in error["message"]
        assert "3 generations" in error["message"]
        assert [b.id for b in client.batches.list().data] == [first.id]  # the refused batch was never created
        again = wait_for(client, submit(client, batch_file(tmp_path, lines, "again.jsonl")).id, ("completed", "failed"))
        assert again.status == "completed" and again.model_extra["tokenmill"]["cost_usd"] == 0
        assert again.request_counts.completed == first.request_counts.completed
