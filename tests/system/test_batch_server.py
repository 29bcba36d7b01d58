"""`tokenmill serve` as a process that must survive its own crash and its clients: connections that never
finish their headers, a server killed mid-batch, two servers on one output root, tenants that crowd each other."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import openai
import pytest
import uvicorn

from pipeline.serve.app import create_app
from pipeline.serve.listen import uvicorn_config
from pipeline.serve.store import ApiStore
from pipeline.stores import storage
from tests.integration.test_batch_files import OTHER, chat
from tests.system.test_batch_api import Server, batch_file, config_for, submit, wait_for  # noqa: F401 (a fixture)


def listening(config) -> tuple[uvicorn.Server, int]:
    """The API alone (no runner) as `tokenmill serve` listens, on a free local port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(config, ApiStore(storage.resolve(config.output.uri)))
    server = uvicorn.Server(uvicorn_config(app, config.serve, "127.0.0.1", port, "warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, port


def test_a_connection_trickling_its_headers_is_cut_off_and_a_prompt_one_is_answered(config_for):  # noqa: F811
    server, port = listening(config_for(serve__header_timeout_seconds=0.5))
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=20) as trickler:
            trickler.sendall(b"GET /v1/files HTTP/1.1\r\nHost: x\r\n")
            for n in range(200):  # a header line at a time, never the blank line that ends them
                trickler.sendall(f"X-Slow-{n}: 1\r\n".encode())
                try:
                    trickler.settimeout(0.1)
                    if trickler.recv(1024) == b"":
                        break  # closed by the server
                except TimeoutError:
                    continue
                except ConnectionResetError:
                    break
            else:
                raise AssertionError("the server kept a connection trickling headers for 200 lines")
        # A client that sends its headers at once is answered (401: no key), on a connection kept alive.
        with socket.create_connection(("127.0.0.1", port), timeout=20) as prompt:
            for _ in range(2):
                prompt.sendall(b"GET /v1/files HTTP/1.1\r\nHost: x\r\n\r\n")
                assert prompt.recv(65536).startswith(b"HTTP/1.1 401")
    finally:
        server.should_exit = True


def test_a_deleted_file_leaves_no_copy_and_an_ended_batch_keeps_none_of_its_input(config_for, tmp_path):  # noqa: F811
    marker = "Quillfeather-7731 recorded the harbour's tides"  # text that only this input holds
    # A custom_id with the characters str.splitlines() splits at: its result stays one line.
    lines = [chat(f"d{i}\u2028\u2029\u0085", f"{OTHER} {marker}, entry {i}.") for i in range(2)]
    config = config_for()
    with Server(config, tmp_path / "serve") as server:
        client = server.client()
        batch = submit(client, batch_file(tmp_path, lines))
        done = wait_for(client, batch.id, ("completed", "failed"))
        assert done.status == "completed", done.errors
        output = client.files.content(done.output_file_id).text
        assert [json.loads(line)["custom_id"] for line in output.splitlines()] == [line["custom_id"] for line in lines]
        root = Path(config.output.uri)

        def copies() -> list[str]:
            """Files under the server's areas that hold the input's text."""
            found = [p for area in ("_api", "_staging") for p in (root / area).rglob("*") if p.is_file()]
            return sorted(str(p.relative_to(root)) for p in found if marker.encode() in p.read_bytes())

        assert copies() == [f"_api/files/{batch.input_file_id}.jsonl"]  # the job's copies went when it ended
        assert not (root / "_staging" / f"job={batch.id}").exists()
        client.files.delete(batch.input_file_id)
        assert copies() == []
        with pytest.raises(openai.NotFoundError):
            client.files.content(batch.input_file_id)
