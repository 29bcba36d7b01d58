"""cli: the `tokenmill` command. Wiring only; every verb calls into the pipeline package.

common.py holds the typer app, its groups and the shared helpers; each module below registers the
commands of one concern on import:
  jobs.py     run, rerun, estimate (its old name plan refused, naming it), status, jobs list
  ledger.py   ledger summary, ledger sql, report
  router.py   router train, router eval, router example-labels
  setup.py    config show/docs, models tiny/embedder, samples
  cache.py    cache forget
  tables.py   migrate (the catalog to the latest schema), tables maintain (dead reservations, finished
              jobs' Pushgateway groups)
  checks.py   checks score, checks calibrate (the output checks against your labels)
  evals.py    eval (the hold-out set on every tier: quality next to cost)
  serve.py    serve (the OpenAI-compatible Batch API), api-key
  reference.py  the config reference (docs/config.md) that `config docs` prints, from the typed config
  liblog.py   where a job's library output goes (vLLM, torch, transformers to a log file)
  __main__.py `python -m pipeline.cli`

May import everything in pipeline (the top layer); nothing imports it.
"""

import atexit
import ctypes
import os
import sys
import threading

from pipeline.cli import (  # noqa: F401  (registers the commands)
    cache,
    checks,
    evals,
    jobs,
    ledger,
    router,
    serve,
    setup,
    tables,
)
from pipeline.cli.common import app
from pipeline.cli.jobs import summary_table

__all__ = ["app", "main", "summary_table"]


def main() -> None:
    """Run the command, then leave as Python would (threads joined, exit hooks run: the engines' shutdown
    among them; streams flushed, C's included) but through `os._exit`, skipping interpreter finalization:
    there, the native thread pools of Arrow and DuckDB can abort a process whose work is done and reported
    (`terminate called without an active exception`, exit -6; apache/arrow#34314), and a scheduler would
    take that job for a failure. Seen here once: `tokenmill estimate` printed its whole answer, then died so."""
    if _wrapped():  # under a profiler or a debugger: it has work to do after this returns
        app()
        return
    try:
        app()
        code: object = 0
    except SystemExit as e:
        code = e.code
    if code is not None and not isinstance(code, int):  # sys.exit("message"): printed, exit 1, as Python does
        print(code, file=sys.stderr)
        code = 1
    threading._shutdown()  # what Python does first at exit: wait for non-daemon threads (executors' too)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`tokenmill ... | head`) or stream
            pass
    try:
        ctypes.CDLL(None).fflush(None)  # what native libraries wrote through C's stdio
    except (OSError, AttributeError, TypeError):  # no C library to load by that name (Windows)
        pass
    os._exit(code or 0)


def _wrapped() -> bool:
    monitoring = getattr(sys, "monitoring", None)  # Python 3.12+: profilers and debuggers may use it instead
    tools = [monitoring.get_tool(t) for t in (monitoring.PROFILER_ID, monitoring.DEBUGGER_ID)] if monitoring else []
    return bool(sys.getprofile() or sys.gettrace() or any(tools))


if __name__ == "__main__":
    main()
