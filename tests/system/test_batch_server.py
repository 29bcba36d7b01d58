"""`tokenmill serve` as a process that must survive its own crash and its clients: connections that never
finish their headers, a server killed mid-batch, two servers on one output root, tenants that crowd each other."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from pipeline.serve.app import create_app
from pipeline.serve.listen import uvicorn_config
from pipeline.serve.store import ApiStore
from pipeline.stores import storage
from tests.system.test_batch_api import KEYS, config_for  # noqa: F401  (the fixture)


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
