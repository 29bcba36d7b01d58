"""A small HTTP proxy in front of the real S3 server that can answer 503 SlowDown on purpose.

It forwards every request untouched unless its path contains `fail_pattern`; those get a real
S3-style throttling answer, `fail_times` times (or forever when None), to test retries and outages.
"""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


class FlakyS3Proxy:
    def __init__(self, upstream: str):
        self.upstream = urlparse(upstream)
        self.fail_pattern: str | None = None
        self.fail_times: int | None = None
        self.failed = 0
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _body(self) -> bytes:
                if "chunked" not in self.headers.get("Transfer-Encoding", "").lower():
                    return self.rfile.read(int(self.headers.get("Content-Length") or 0))
                chunks = []
                while True:  # HTTP/1.1 chunked request body (the AWS SDK streams uploads this way)
                    size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass
                        return b"".join(chunks)
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()

            def _handle(self):
                body = self._body()
                if proxy.should_fail(self.path):
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOW_DOWN)))
                    self.end_headers()
                    self.wfile.write(SLOW_DOWN)
                    return
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=30)
                headers = {
                    k: v
                    for k, v in self.headers.items()
                    if k.lower() not in ("connection", "transfer-encoding", "content-length")
                }
                headers["Content-Length"] = str(len(body))
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                # HEAD answers carry the object's length and no body: keep the upstream's.
                length = resp.getheader("Content-Length", "0") if self.command == "HEAD" else str(len(data))
                self.send_header("Content-Length", length)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def should_fail(self, path: str) -> bool:
        with self.lock:
            if self.fail_pattern is None or self.fail_pattern not in unquote(path):
                return False
            if self.fail_times is not None and self.failed >= self.fail_times:
                return False
            self.failed += 1
            return True

    def fail(self, pattern: str | None, times: int | None = None) -> None:
        with self.lock:
            self.fail_pattern, self.fail_times, self.failed = pattern, times, 0

    def close(self) -> None:
        self.server.shutdown()
