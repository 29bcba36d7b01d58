"""Where a job's library output goes: vLLM, torch and transformers to a log file, tokenmill's own lines to the
terminal (or the scheduler's log). And `tokenmill serve`'s logging (serve_logging), set up once as it starts.

A demo run printed 361 lines of engine warnings between tokenmill's own. They come from three places: Python
warnings and loggers in this process, the engine's child processes (which inherit file descriptors 1 and 2),
and C++ code writing to those descriptors. So descriptors 1 and 2 go to the file, which catches the last two,
while `sys.stdout` and `sys.stderr` keep the terminal; and the logging handler on the terminal passes only
tokenmill's loggers, a file handler taking every other one (vLLM's logs propagate to it instead of printing
on their own: VLLM_CONFIGURE_LOGGING=0), with Python warnings logged too. `-v` keeps it all on the terminal.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel, SecretStr

from pipeline.config.env import redact_url, scrub, url_credentials

OWN = ("tokenmill", "pipeline")  # the loggers whose lines a user of `tokenmill run` reads
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@contextlib.contextmanager
def library_output(home: Path, verbose: bool) -> Iterator[Path | None]:
    """Within the block, library output goes to `<home>/logs/run-<UTC time>-<pid>.log` (yielded; None with
    `verbose`, or when that file cannot be written: everything on the terminal, as before). Logging is set up
    here either way, and every change (descriptors, streams, handlers, environment) is undone on the way out,
    whatever ends the block."""
    root = logging.getLogger()
    with contextlib.ExitStack() as undo:
        handlers, level = root.handlers[:], root.level  # given back after the block (a test runs many jobs)
        undo.callback(_set_handlers, root, handlers, level)
        opened = None if verbose else _open_log(home)
        if opened is None:
            _set_handlers(root, [logging.StreamHandler(sys.stderr)], logging.INFO, FORMAT)
            yield None
            return
        log_fd, path = opened
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        for fd in (1, 2):
            saved = os.dup(fd)
            undo.callback(os.close, saved)
            undo.callback(os.dup2, saved, fd)
        # The streams keep the terminal: new ones on copies of descriptors 1 and 2, taken before these go to the file.
        streams = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _terminal_stream(sys.stdout, 1), _terminal_stream(sys.stderr, 2)
        undo.callback(_restore_streams, streams)
        for fd in (1, 2):
            os.dup2(log_fd, fd)
        os.close(log_fd)
        # A library that sets up a handler of its own during the job (torch does, when vLLM first imports it)
        # takes `sys.stderr` by default: give it the file instead (the process's own stream, now on it).
        stream_handler_init = logging.StreamHandler.__init__

        def to_file(handler, stream=None):
            stream_handler_init(handler, streams[1] if stream is None else stream)

        logging.StreamHandler.__init__ = to_file
        undo.callback(setattr, logging.StreamHandler, "__init__", stream_handler_init)
        undo.callback(_set_env, "VLLM_CONFIGURE_LOGGING", os.environ.get("VLLM_CONFIGURE_LOGGING"))
        os.environ["VLLM_CONFIGURE_LOGGING"] = "0"
        terminal = logging.StreamHandler(sys.stderr)
        terminal.addFilter(lambda record: record.name.startswith(OWN))
        terminal.setFormatter(Wrapped("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
        library = logging.FileHandler(path, encoding="utf-8")
        undo.callback(library.close)
        library.addFilter(lambda record: not record.name.startswith(OWN))
        _set_handlers(root, [terminal, library], logging.INFO, FORMAT)
        logging.captureWarnings(True)
        undo.callback(logging.captureWarnings, False)
        yield path


# A URL inside a log line (a message or a traceback naming one): its password and secret parameters go.
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>]+")


def serve_logging(cfg, stream=None) -> None:
    """`tokenmill serve`'s logging: every logger's lines (tokenmill's, the batch runner's, uvicorn's) on `stream`
    (stderr) in one format, from `serve.log_level` up, with credentials redacted (Redacted). Process-wide and
    for the server's lifetime: the root logger's handlers are replaced, once, as it starts."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(Redacted(FORMAT, secrets=config_secrets(cfg)))
    _set_handlers(logging.getLogger(), [handler], getattr(logging, cfg.serve.log_level.upper()))
    logging.captureWarnings(True)


def config_secrets(value) -> tuple[list[str], list[str]]:
    """(URLs carrying a password, secret values) anywhere in a config: what a log line must never show."""
    urls, secrets = [], []

    def walk(v) -> None:
        if isinstance(v, SecretStr):
            secrets.append(v.get_secret_value())
        elif isinstance(v, BaseModel):
            for name in type(v).model_fields:
                walk(getattr(v, name))
        elif isinstance(v, dict):
            for item in v.values():
                walk(item)
        elif isinstance(v, (list, tuple)):
            for item in v:
                walk(item)
        elif isinstance(v, str) and url_credentials(v) is not None:
            urls.append(v)

    walk(value)
    return urls, [s for s in secrets if s]


class Redacted(logging.Formatter):
    """Lines (message and traceback) with no credential: every URL in them through redact_url, the config's
    own URLs through scrub (a password echoed apart from its URL), and the config's secret values as `***`."""

    def __init__(self, fmt: str, secrets: tuple[list[str], list[str]] = ([], [])):
        super().__init__(fmt)
        self.urls, self.secrets = secrets

    def format(self, record: logging.LogRecord) -> str:
        text = scrub(super().format(record), *self.urls)
        for secret in self.secrets:
            text = text.replace(secret, "***")
        return _URL.sub(lambda m: redact_url(m.group(0)), text)


class Wrapped(logging.Formatter):
    """Lines of at most WIDTH characters, continued on indented lines: a message naming a long path stays
    readable in a scheduler's log, as the job summary does (the console is 100 columns wide off a terminal)."""

    WIDTH = 100

    def format(self, record: logging.LogRecord) -> str:
        return "\n".join(
            textwrap.fill(line, self.WIDTH, subsequent_indent="    ", break_long_words=True, break_on_hyphens=False)
            if len(line) > self.WIDTH
            else line
            for line in super().format(record).splitlines()
        )


def _open_log(home: Path) -> tuple[int, Path] | None:
    """An open descriptor on a new log file under `home`/logs, or None (and a warning) when it cannot be made."""
    path = home / "logs" / f"run-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}.log"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), path
    except OSError as e:
        print(
            f"warning: cannot write {path} ({e.strerror or e}); engine and library messages stay here", file=sys.stderr
        )
        return None


def _terminal_stream(stream, fd: int):
    """The stream tokenmill's output keeps: a new one on a copy of descriptor `fd` when `stream` is the process's
    own (that descriptor is about to go to the file), else `stream` (e.g. a test runner's buffer) as it is."""
    try:
        if stream.fileno() == fd:
            return open(
                os.dup(fd),
                "w",
                buffering=1,
                encoding=getattr(stream, "encoding", None) or "utf-8",
                errors="backslashreplace",
            )
    except (AttributeError, OSError, ValueError):
        pass
    return stream


def _restore_streams(streams: tuple) -> None:
    """Flush and close the terminal streams made for the block, and put the process's own back."""
    for new, old in zip((sys.stdout, sys.stderr), streams):
        new.flush()
        if new is not old:
            new.close()
    sys.stdout, sys.stderr = streams


def _set_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _set_handlers(root: logging.Logger, handlers: list, level: int, fmt: str | None = None) -> None:
    """The root logger's handlers, replaced without closing the old ones (they are put back afterwards)."""
    for handler in handlers:
        if fmt is not None and handler.formatter is None:
            handler.setFormatter(logging.Formatter(fmt))
    root.handlers[:] = handlers
    root.setLevel(level)
