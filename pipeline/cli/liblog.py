"""Where a job's library output goes: vLLM, torch and transformers to a log file, tokenmill's own lines to the
terminal (or the scheduler's log).

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
import sys
import time
from collections.abc import Iterator
from pathlib import Path

OWN = ("tokenmill", "pipeline")  # the loggers whose lines a user of `tokenmill run` reads
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _terminal_stream(stream, fd: int, saved: int):
    """The stream tokenmill's output keeps: a new one on the saved descriptor when `stream` is the process's own
    (its descriptor is about to go to the file), else `stream` (e.g. a test runner's buffer) as it is."""
    try:
        if stream.fileno() == fd:
            return open(saved, "w", buffering=1, encoding=getattr(stream, "encoding", None) or "utf-8",
                        errors="backslashreplace", closefd=False)
    except (AttributeError, OSError, ValueError):
        pass
    return stream


@contextlib.contextmanager
def library_output(home: Path, verbose: bool) -> Iterator[Path | None]:
    """Within the block, library output goes to `<home>/logs/run-<UTC time>-<pid>.log` (yielded; None with
    `verbose`: everything on the terminal, as before). Logging is configured here either way."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level  # given back after the block (a test runs many jobs)
    if verbose:
        logging.basicConfig(level=logging.INFO, format=FORMAT, stream=sys.stderr, force=True)
        try:
            yield None
        finally:
            root.handlers[:] = handlers
            root.setLevel(level)
        return
    path = home / "logs" / f"run-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _terminal_stream(sys.stdout, 1, saved[1]), _terminal_stream(sys.stderr, 2, saved[2])
    log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    for fd in (1, 2):
        os.dup2(log_fd, fd)
    os.close(log_fd)
    previous = os.environ.get("VLLM_CONFIGURE_LOGGING")
    os.environ["VLLM_CONFIGURE_LOGGING"] = "0"
    terminal = logging.StreamHandler(sys.stderr)
    terminal.addFilter(lambda record: record.name.startswith(OWN))
    terminal.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))  # lines < 120 wide
    library = logging.FileHandler(path, encoding="utf-8")
    library.addFilter(lambda record: not record.name.startswith(OWN))
    logging.basicConfig(level=logging.INFO, format=FORMAT, handlers=[terminal, library], force=True)
    logging.captureWarnings(True)
    try:
        yield path
    finally:
        logging.captureWarnings(False)
        root.handlers[:] = handlers
        root.setLevel(level)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        library.close()
        for fd in (1, 2):
            os.dup2(saved[fd], fd)
            os.close(saved[fd])
        sys.stdout, sys.stderr = streams
        if previous is None:
            os.environ.pop("VLLM_CONFIGURE_LOGGING", None)
        else:
            os.environ["VLLM_CONFIGURE_LOGGING"] = previous
