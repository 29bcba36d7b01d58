"""How `tokenmill serve` listens: uvicorn on h11, with a deadline for a request's headers.

uvicorn closes a keep-alive connection idle for `timeout_keep_alive` once a response was sent, but has no
deadline for the headers of a request: a client that opens a connection and trickles header lines (or
nothing) holds it, and a file descriptor, for as long as it likes. `HeaderDeadline` closes any connection
whose next request's headers are not complete `serve.header_timeout_seconds` after it opened or after its
last response; a request whose headers arrived is not timed by it (its body and its answer may take long).
"""

from __future__ import annotations

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from pipeline.config import ServeConfig

MAX_HEADER_BYTES = 16 * 1024  # h11's largest incomplete event: a request's line and headers together


class HeaderDeadline(H11Protocol):
    header_timeout: float = 10.0  # set per server by `uvicorn_config`

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_header_deadline()

    def on_response_complete(self) -> None:
        self._arm_header_deadline()  # before the next pipelined request, if any, starts
        super().on_response_complete()

    def connection_lost(self, exc) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
        super().connection_lost(exc)

    _header_deadline = None

    def _arm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
        # A request whose headers are complete gets a new scope: the same one at the deadline means none came.
        waiting_since = self.scope
        self._header_deadline = self.loop.call_later(self.header_timeout, self._headers_late, waiting_since)

    def _headers_late(self, waiting_since) -> None:
        if self.scope is waiting_since and not self.transport.is_closing():
            self.logger.info("closing a connection whose request headers took over %s s", self.header_timeout)
            self.transport.close()


def uvicorn_config(app, serve: ServeConfig, host: str, port: int, log_level: str = "info") -> uvicorn.Config:
    """The server's uvicorn settings: its timeouts from `serve`, h11 with the header deadline."""
    protocol = type("ServeProtocol", (HeaderDeadline,), {"header_timeout": serve.header_timeout_seconds})
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        log_config=None,  # uvicorn's lines go to the root logger `tokenmill serve` set up (liblog.serve_logging)
        http=protocol,
        timeout_keep_alive=serve.keep_alive_seconds,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
    )
