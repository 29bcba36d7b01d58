"""A real Airflow 3 deployment for tests: api-server, scheduler and dag-processor, with the LocalExecutor
or with the CeleryExecutor and Celery workers, each its own process with its own queues and environment.

Not `dag.test()`: each service is its own process, as in production. The scheduler's LocalExecutor
forks real task processes, which talk to the api-server's execution API (never to the metadata
database); the dag-processor parses the DAG files and serialises them. So whatever a task process
needs in its environment (TOKENMILL_* settings, a fault hook) goes into the services' environment.

    with AirflowDeployment(home, dags_folder, sql_alchemy_conn, env={...}) as af:
        af.create_pool("gpu-small", 1)
        af.wait_for_dag("nightly_summarization")
        af.unpause("nightly_summarization")
        run_id = af.trigger("nightly_summarization", conf={...}, logical_date="2026-11-29T00:00:00Z")
        run = af.wait_for_run("nightly_summarization", run_id)
        states = af.task_states("nightly_summarization", run_id)

Everything lives under `home` (AIRFLOW_HOME, the service logs `<service>.log`, task logs under
`logs/`). The metadata database is the caller's: `airflow_database()` makes a throwaway, migrated one on a
PostgreSQL server. The api-server listens on a free loopback port; `[api] base_url` names it, so
that tasks reach the execution API (a wrong base URL fails every task). REST calls authenticate as
a real client would with the simple auth manager: a user and password from its passwords file,
exchanged for a JWT at `POST /auth/token`. `stop()` ends every service with its process group and
every process it started (task processes, engine processes), however they were spawned.

CeleryExecutor (`executor="CeleryExecutor", broker_url=<redis URL>`): the topology shipped in
infra/single-host/docker-compose.yaml. Its Airflow components (api-server, scheduler, dag-processor,
triggerer) run with their compose commands, and every process gets the compose file's Airflow settings;
only what names this machine (database, broker, api-server URLs) and the secrets are the test's own.
The scheduler sends each task to its queue on the broker; `start_worker(name, service, env=...)` starts
a compose worker service's command (`celery worker --queues ... --concurrency ...`) with that service's
own environment, as a process of its own whose task processes report `name` as their hostname (so a
task instance's `hostname` says which worker ran it); `kill_worker(name)` SIGKILLs it with every process
it started. The result backend is the metadata database.

Fault hook: `fault_hook_env(dir, spec_file)` gives PYTHONPATH and TOKENMILL_TEST_FAULTS for a
`sitecustomize` that registers an injector through `pipeline.job.faults.inject` in every process that
imports `pipeline.job.faults` (so in task processes, which the scheduler forks). The injector reads
`spec_file` at every fault point: while it exists and names (job, partition, point), that partition
fails there; delete the file and the fault is gone, without restarting anything.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import yaml

from tests.servers import free_port

SERVICES = ("api-server", "scheduler", "dag-processor")  # the LocalExecutor's deployment
COMPOSE = Path(__file__).resolve().parents[1] / "infra" / "single-host" / "docker-compose.yaml"
# Compose settings that name the compose network's hosts or hold its secrets: the test deployment's own.
_LOCAL_SETTINGS = (
    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN",
    "AIRFLOW__CELERY__BROKER_URL",
    "AIRFLOW__CELERY__RESULT_BACKEND",
    "AIRFLOW__CORE__EXECUTION_API_SERVER_URL",
    "AIRFLOW__API__BASE_URL",
    "AIRFLOW__API_AUTH__JWT_SECRET",
    "AIRFLOW__API__SECRET_KEY",
    "AIRFLOW__CORE__FERNET_KEY",
)
# What a Celery worker's task processes call for their hostname (`[core] hostname_callable`): the
# worker's name, so that workers sharing this host are told apart in the task instances' `hostname`.
_WORKER_NAME_MODULE = "tokenmill_test_worker_name"
_WORKER_NAME_SOURCE = '''"""Written by tests/airflow_deploy.py: a Celery worker's name, its tasks' hostname."""
import os


def hostname() -> str:
    return os.environ["TOKENMILL_TEST_WORKER"]
'''
FINISHED = ("success", "failed")
ENGINE_LOCK = "/tmp/tokenmill-engine.lock"  # held around anything that starts vLLM on this machine


class AirflowError(RuntimeError):
    """A service died or did not become healthy, a DAG failed to import, or a wait ran out."""


# The compose topology ----------------------------------------------------------------------------


def compose_services() -> dict[str, dict]:
    """The compose file's services that run the tokenmill image (Airflow's components and workers)."""
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    return {name: svc for name, svc in services.items() if svc.get("image", "").startswith("tokenmill-")}


def compose_control_plane() -> list[list[str]]:
    """The long-running Airflow components' commands (not the one-shot init, not the Celery workers)."""
    return [
        svc["command"]
        for svc in compose_services().values()
        if svc.get("restart") != "no" and svc["command"][:1] != ["celery"]
    ]


def compose_airflow_settings() -> dict[str, str]:
    """The AIRFLOW__* settings every compose component shares, less the machine's addresses and secrets."""
    shared = compose_services()["airflow-scheduler"]["environment"]
    return {k: str(v) for k, v in shared.items() if k.startswith("AIRFLOW__") and k not in _LOCAL_SETTINGS}


def compose_worker(service: str) -> tuple[list[str], dict[str, str]]:
    """A compose worker service's command and the environment it sets beyond the shared one, less its
    metrics endpoint (a fixed port, which workers sharing this machine cannot all take)."""
    services = compose_services()
    svc, shared = services[service], services["airflow-scheduler"]["environment"]
    own = {k: str(v) for k, v in svc["environment"].items() if k not in shared}
    return svc["command"], {k: v for k, v in own.items() if not k.startswith("TOKENMILL_METRICS__")}


# The metadata database ---------------------------------------------------------------------------


@contextlib.contextmanager
def airflow_database(admin_url: str, prefix: str = "airflow_test") -> Iterator[str]:
    """A fresh PostgreSQL database `<prefix>_<random>` on the server `admin_url` names (a SQLAlchemy URL, e.g.
    conftest's postgres_admin_url), already migrated: a copy of `migrated_template`'s. Yields its URL, dropped
    (forced) afterwards."""
    from sqlalchemy import text

    admin, template = _admin(admin_url), migrated_template(admin_url)
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    with admin.connect() as c:
        c.execute(text(f'CREATE DATABASE "{name}" TEMPLATE "{template}"'))
    try:
        yield _database_url(admin_url, name)
    finally:
        with admin.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def _admin(admin_url: str):
    from sqlalchemy import create_engine

    return create_engine(admin_url, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 5})


def _database_url(admin_url: str, name: str) -> str:
    from sqlalchemy.engine import make_url

    url = make_url(admin_url).set(database=name)
    if url.drivername == "postgresql":
        url = url.set(drivername="postgresql+psycopg")  # psycopg 3 is what this venv has
    return url.render_as_string(hide_password=False)


def migrated_template(admin_url: str) -> str:
    """The name of a database that `airflow db migrate` of these Airflow releases made, on the server, made once
    per server and set of releases: each deployment's database is a copy (`CREATE DATABASE ... TEMPLATE`, well under a
    second, where migrating takes 8 to 20 s). Built under an advisory lock (test workers are processes) with
    another name, renamed once complete: a build killed half-way is never copied."""
    import hashlib
    from importlib.metadata import distributions

    from sqlalchemy import text

    # Keyed by every installed Airflow distribution's version: a provider's upgrade can bring migrations too.
    releases = sorted(f"{d.metadata['Name']}=={d.version}" for d in distributions() if "airflow" in d.metadata["Name"])
    name = f"airflow_template_{hashlib.sha256(' '.join(releases).encode()).hexdigest()[:16]}"
    admin = _admin(admin_url)
    try:
        with admin.connect() as c:
            c.execute(text("SELECT pg_advisory_lock(hashtext('tokenmill-airflow-template'))"))
            try:
                if c.execute(text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}).first() is None:
                    building = f"{name}_building"
                    c.execute(text(f'DROP DATABASE IF EXISTS "{building}" WITH (FORCE)'))
                    c.execute(text(f'CREATE DATABASE "{building}"'))
                    with tempfile.TemporaryDirectory() as home:
                        AirflowDeployment(Path(home), Path(home), _database_url(admin_url, building)).airflow(
                            "db", "migrate"
                        )
                    c.execute(text(f'ALTER DATABASE "{building}" RENAME TO "{name}"'))
            finally:
                c.execute(text("SELECT pg_advisory_unlock(hashtext('tokenmill-airflow-template'))"))
    finally:
        admin.dispose()
    return name


# Engine lock -------------------------------------------------------------------------------------


@contextlib.contextmanager
def engine_lock(timeout: float = 1800.0, path: str = ENGINE_LOCK) -> Iterator[None]:
    """Hold `flock` on the machine-wide engine lock (as `flock /tmp/tokenmill-engine.lock CMD` does): no
    other vLLM engine run starts meanwhile. Waits like flock(1), in line with its other waiters, at
    most `timeout` seconds (on the main thread; elsewhere it waits as long as it takes)."""
    with open(path, "a+") as f:
        main = threading.current_thread() is threading.main_thread()

        def expired(signum, frame):
            raise AirflowError(f"{path} still held by another engine run after {timeout:.0f} s")

        previous = signal.signal(signal.SIGALRM, expired) if main else None
        if main:
            signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            fcntl.flock(f, fcntl.LOCK_EX)  # blocking, as flock(1) waits
        finally:
            if main:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# Fault hook --------------------------------------------------------------------------------------

_SITECUSTOMIZE = '''\
"""Written by tests/airflow_deploy.py: fault injection in processes the test does not run itself.

Once `pipeline.job.faults` is imported, registers (through faults.inject) an injector that reads
$TOKENMILL_TEST_FAULTS (JSON: a list of {"job": id or null, "partition": p, "point": name or null,
"error": message}) at every fault point and raises OSError where an entry matches."""
import importlib.abc
import importlib.machinery
import json
import os
import sys

_SPEC = os.environ.get("TOKENMILL_TEST_FAULTS")
_TARGET = "pipeline.job.faults"


def _injector(point, job_id, partition):
    try:
        with open(_SPEC, encoding="utf-8") as f:
            entries = json.load(f)
    except FileNotFoundError:
        return
    for e in entries:
        if e.get("partition") == partition and e.get("job") in (None, job_id) and e.get("point") in (None, point):
            raise OSError(e.get("error") or f"injected fault at {point} of {partition}")


_ACTIVE = []  # the entered context managers: a collected one would close and remove its injector


def _register(module):
    cm = module.inject(_injector)
    cm.__enter__()  # for the life of the process
    _ACTIVE.append(cm)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module):
            run(module)
            _register(module)

        loader.exec_module = exec_module
        return spec


if _SPEC:
    if _TARGET in sys.modules:
        _register(sys.modules[_TARGET])
    else:
        sys.meta_path.insert(0, _Finder())
'''


def fault_hook_env(hook_dir: Path, spec_file: Path) -> dict[str, str]:
    """Environment that makes every process importing pipeline.job.faults honour `spec_file` (see
    the module docstring). Write the spec with `write_faults`; delete the file to lift the faults."""
    hook_dir.mkdir(parents=True, exist_ok=True)
    (hook_dir / "sitecustomize.py").write_text(_SITECUSTOMIZE, encoding="utf-8")
    path = os.pathsep.join(p for p in (str(hook_dir), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "TOKENMILL_TEST_FAULTS": str(spec_file)}


def write_faults(spec_file: Path, entries: list[dict]) -> None:
    tmp = spec_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(entries), encoding="utf-8")
    tmp.replace(spec_file)  # atomic: a task process never reads half a spec


def _async_url(url: str) -> str | None:
    """Airflow's async engine URL for `url`: for PostgreSQL, psycopg 3 (Airflow would guess asyncpg,
    which this venv lacks; psycopg 3 is async too). None: Airflow's own guess (aiosqlite for SQLite)."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.get_backend_name() != "postgresql":
        return None
    return parsed.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)


def _end_with_parent() -> None:
    """In a service, before exec: SIGTERM it when the test process dies without its teardown (killed,
    timed out), so that no scheduler outlives the test run. Linux only; elsewhere a no-op."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


# The deployment ----------------------------------------------------------------------------------


class AirflowDeployment:
    """api-server + scheduler + dag-processor under an isolated AIRFLOW_HOME; with the CeleryExecutor,
    the Celery workers the caller starts."""

    USER = "tokenmill-test"

    def __init__(
        self,
        home: Path,
        dags_folder: Path,
        sql_alchemy_conn: str,
        env: dict[str, str] | None = None,
        parallelism: int = 8,
        python: str = sys.executable,
        drop_env: tuple[str, ...] = ("AIRFLOW",),
        preload: tuple[str, ...] = (),
        executor: str = "LocalExecutor",
        broker_url: str | None = None,
    ):
        """env: added to the services' environment (and so to every task process's); drop_env: prefixes
        of this process's variables the services do not inherit (pass `env` the ones to keep); preload:
        modules the scheduler imports at start, so that the task processes it forks have them (each
        would otherwise import them again: seconds of CPU per task); executor: LocalExecutor, or
        CeleryExecutor with `broker_url` (Redis)."""
        if executor == "CeleryExecutor" and not broker_url:
            raise ValueError("the CeleryExecutor needs a broker_url")
        self.executor, self.broker_url = executor, broker_url
        self.workers: dict[str, subprocess.Popen] = {}
        self.home, self.dags_folder, self.conn = Path(home), Path(dags_folder), sql_alchemy_conn
        self.drop_env, self.preload = drop_env, preload
        self.extra_env, self.parallelism, self.python = dict(env or {}), parallelism, python
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.password = secrets.token_urlsafe(16)
        self.jwt_secret = secrets.token_urlsafe(32)
        self.fernet_key = base64.urlsafe_b64encode(secrets.token_bytes(32)).decode()  # a Fernet key's form
        self.services = [[name] for name in SERVICES] if executor == "LocalExecutor" else compose_control_plane()
        self.procs: dict[str, subprocess.Popen] = {}
        self._token: str | None = None
        self._client = httpx.Client(base_url=self.url, timeout=30.0)

    # -- environment and lifecycle

    def environ(self) -> dict[str, str]:
        """The services' environment: this process's, minus the `drop_env` prefixes (any AIRFLOW_* of its
        own), plus the deployment's settings and the caller's `env` (which task processes inherit)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(self.drop_env)}
        passwords = self.home / "passwords.json"
        if self.executor == "CeleryExecutor":
            env.update(compose_airflow_settings())  # the shipped settings; what follows is this machine's
        env.update(
            {
                "AIRFLOW_HOME": str(self.home),
                "AIRFLOW__CORE__DAGS_FOLDER": str(self.dags_folder),
                "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
                "AIRFLOW__CORE__EXECUTOR": self.executor,
                "AIRFLOW__CORE__PARALLELISM": str(self.parallelism),
                "AIRFLOW__CORE__DAGBAG_IMPORT_TIMEOUT": "180",
                "AIRFLOW__CORE__DAG_FILE_PROCESSOR_TIMEOUT": "240",
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": self.conn,
                "AIRFLOW__DATABASE__CHECK_MIGRATIONS": "False",  # migrated once, before the services start
                # The api-server, and where tasks find its execution API: both must name this port.
                "AIRFLOW__API__HOST": "127.0.0.1",
                "AIRFLOW__API__PORT": str(self.port),
                "AIRFLOW__API__WORKERS": "1",
                "AIRFLOW__API__BASE_URL": f"{self.url}/",
                "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.url}/execution/",
                # Shared secrets: the scheduler signs the tokens the api-server checks.
                "AIRFLOW__API_AUTH__JWT_SECRET": self.jwt_secret,
                "AIRFLOW__API__SECRET_KEY": self.jwt_secret,
                "AIRFLOW__CORE__FERNET_KEY": self.fernet_key,
                "AIRFLOW__CORE__AUTH_MANAGER": (
                    "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager"
                ),
                "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{self.USER}:admin",
                "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords),
                # Only triggered runs: unpausing the DAG must not start a scheduled one beside the test's.
                "AIRFLOW__SCHEDULER__USE_JOB_SCHEDULE": "False",
                # Find the dags folder's files at once (default: every 300 s), then leave a parsed file alone
                # (default: parsed again every 30 s, each time importing pipeline: CPU a test needs).
                "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
                "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "600",
                "AIRFLOW__DAG_PROCESSOR__PARSING_PROCESSES": "1",
                "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(self.home / "logs"),
                # A task's calls to the execution API (start, heartbeat, XCom) time out after 5 s by default, and
                # three failed heartbeats kill it: on 2 cores with the rest of the suite (vLLM, model builds)
                # beside it, the one api-server process answers late, not never. A task ends by its own result.
                "AIRFLOW__WORKERS__EXECUTION_API_TIMEOUT": "60",
                "AIRFLOW__WORKERS__MAX_FAILED_HEARTBEATS": "20",
            }
        )
        if (async_url := _async_url(self.conn)) is not None:
            env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_ASYNC"] = async_url
        if self.executor == "CeleryExecutor":
            # the compose file's other Celery settings (acks late, one reserved task per slot) came above
            env.update(
                {"AIRFLOW__CELERY__BROKER_URL": self.broker_url, "AIRFLOW__CELERY__RESULT_BACKEND": f"db+{self.conn}"}
            )
        env.update(self.extra_env)
        return env

    def airflow(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        """Run one `airflow` CLI command against this deployment (raises on a non-zero exit)."""
        done = subprocess.run(
            [self.python, "-m", "airflow", *args],
            env=self.environ(),
            cwd=self.home,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if done.returncode:
            raise AirflowError(f"airflow {' '.join(args)} exited {done.returncode}:\n{done.stderr[-4000:]}")
        return done

    def start(self, timeout: float = 240) -> None:
        """Start the services over the (migrated: `airflow_database`) metadata database, wait until the
        api-server reports the scheduler and dag-processor healthy. On any failure they are stopped again."""
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "passwords.json").write_text(json.dumps({self.USER: self.password}))
        self._write_preload()
        try:
            env = self.environ()
            for command in self.services:
                local = ["--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"]
                self.procs[command[0]] = self._spawn(
                    command + (local if command == ["api-server"] else []), env, command[0]
                )
            self.wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise

    def _spawn(self, args: list[str], env: dict[str, str], log_name: str) -> subprocess.Popen:
        """`airflow <args>` as a process in a session of its own (stop() ends its whole process group),
        its output to `<home>/<log_name>.log`."""
        with open(self.home / f"{log_name}.log", "ab") as log:
            return subprocess.Popen(
                [self.python, "-m", "airflow", *args],
                env=env,
                cwd=self.home,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_end_with_parent,
            )

    def start_worker(self, name: str, service: str, env: dict[str, str] | None = None):
        """The compose worker `service` (its command: queues, concurrency; its own environment, e.g. the
        tiers its GPUs serve), `env` added to its environment only. Its task processes report `name` as
        hostname."""
        command, own_env = compose_worker(service)
        lib = self.home / "worker-lib"
        lib.mkdir(exist_ok=True)
        (lib / f"{_WORKER_NAME_MODULE}.py").write_text(_WORKER_NAME_SOURCE)
        base = self.environ()
        worker_env = {
            **base,
            "PYTHONPATH": os.pathsep.join(p for p in (str(lib), base.get("PYTHONPATH", "")) if p),
            "AIRFLOW__CORE__HOSTNAME_CALLABLE": f"{_WORKER_NAME_MODULE}.hostname",
            "TOKENMILL_TEST_WORKER": name,
            **own_env,
            **(env or {}),
        }
        args = command + [
            "--celery-hostname",
            f"{name}@%h",
            "--without-gossip",
            "--without-mingle",
            "--skip-serve-logs",
        ]
        self.workers[name] = self._spawn(args, worker_env, f"worker-{name}")
        return self.workers[name]

    def kill_worker(self, name: str) -> None:
        """SIGKILL a Celery worker and every process it started (pool, task supervisors, task processes):
        a machine lost mid-task, with no chance to hand anything back."""
        import psutil

        proc = self.workers.pop(name)
        try:
            family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        except psutil.Error:
            family = []
        for p in family:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(family, timeout=30)
        proc.wait()

    def _write_preload(self) -> None:
        """airflow_local_settings.py, which every Airflow process imports from $AIRFLOW_HOME/config at
        start: in the scheduler and in Celery workers it imports `preload`. The LocalExecutor's workers are
        forked from the scheduler, a Celery worker's pool from the worker, and they fork each task process,
        which so inherits the modules (a deployment's usual tuning)."""
        if not self.preload:
            return
        config = self.home / "config"
        config.mkdir(exist_ok=True)
        (config / "airflow_local_settings.py").write_text(
            "# Written by tests/airflow_deploy.py: modules the scheduler's forked task processes inherit.\n"
            "import importlib\nimport sys\n\n"
            f"if sys.argv[1:2] in (['scheduler'], ['celery']):\n    for name in {list(self.preload)!r}:\n"
            "        importlib.import_module(name)\n"
        )

    def wait_healthy(self, timeout: float = 240) -> dict:
        deadline, health = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                health = self._client.get("/api/v2/monitor/health").json()
                components = ("metadatabase", "scheduler", "dag_processor") + (
                    ("triggerer",) if "triggerer" in self.procs else ()
                )
                if all((health.get(k) or {}).get("status") == "healthy" for k in components):
                    return health
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(1.0)
        raise AirflowError(f"not healthy after {timeout:.0f} s: {health}\n{self.log_tails()}")

    def wait_until(self, condition, limit: float = 300.0, poll: float = 0.5) -> None:
        """Poll until `condition()` holds, the services alive; `limit` only guards against a hang (the state
        waited for is made to happen)."""
        deadline = time.monotonic() + limit
        while not condition():
            self.check_alive()
            if time.monotonic() > deadline:
                raise AirflowError(f"not reached in {limit:.0f} s\n{self.log_tails()}")
            time.sleep(poll)

    def check_alive(self) -> None:
        procs = {**self.procs, **{f"worker-{w}": p for w, p in self.workers.items()}}
        dead = {n: p.returncode for n, p in procs.items() if p.poll() is not None}
        if dead:
            raise AirflowError(f"Airflow services exited: {dead}\n{self.log_tails()}")

    def log_tails(self, chars: int = 3000) -> str:
        out = []
        for name in (*self.procs, *(f"worker-{w}" for w in self.workers)):
            log = self.home / f"{name}.log"
            if log.exists():
                out.append(f"--- {name}.log (tail)\n{log.read_text(errors='replace')[-chars:]}")
        return "\n".join(out)

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM every service's process group, then SIGKILL whatever of it (and of any process it
        started, even in a session of its own) is left after `grace` seconds."""
        import psutil

        self._client.close()
        procs, self.procs = {**self.procs, **self.workers}, {}
        self.workers = {}
        descendants: list[psutil.Process] = []
        for p in procs.values():
            with contextlib.suppress(psutil.Error):
                descendants += psutil.Process(p.pid).children(recursive=True)
        for p in procs.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.1, deadline - time.monotonic()))
        for p in procs.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        _, alive = psutil.wait_procs(descendants, timeout=max(0.1, deadline - time.monotonic()))
        for d in alive:
            with contextlib.suppress(psutil.Error):
                d.kill()
        psutil.wait_procs(alive, timeout=10)

    def __enter__(self) -> AirflowDeployment:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- REST API (v2)

    @property
    def token(self) -> str:
        if self._token is None:
            r = self._client.post("/auth/token", json={"username": self.USER, "password": self.password})
            if r.status_code >= 300:
                raise AirflowError(f"POST /auth/token: {r.status_code} {r.text[:500]}")
            self._token = r.json()["access_token"]
        return self._token

    def api(
        self,
        method: str,
        path: str,
        json_body: dict | None = None,
        params: dict | None = None,
        ok: tuple[int, ...] = (200, 201, 204),
    ):
        """One authenticated REST call under /api/v2; returns the decoded JSON (None when empty)."""
        r = self._client.request(
            method, f"/api/v2{path}", json=json_body, params=params, headers={"Authorization": f"Bearer {self.token}"}
        )
        if r.status_code not in ok:
            raise AirflowError(f"{method} /api/v2{path}: {r.status_code} {r.text[:2000]}")
        return r.json() if r.content else None

    def create_pool(self, name: str, slots: int, description: str = "") -> dict:
        return self.api(
            "POST", "/pools", {"name": name, "slots": slots, "description": description, "include_deferred": False}
        )

    def import_errors(self) -> list[dict]:
        return self.api("GET", "/importErrors", params={"limit": 100})["import_errors"]

    def wait_for_dag(self, dag_id: str, timeout: float = 180) -> dict:
        """The DAG once the dag-processor has serialised it; raises at once on an import error."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            errors = self.import_errors()
            if errors:
                raise AirflowError(
                    "DAG import errors:\n" + "\n".join(f"{e['filename']}: {e['stack_trace']}" for e in errors)
                )
            dag = self.api("GET", f"/dags/{dag_id}", ok=(200, 404))
            if dag and dag.get("dag_id") == dag_id:
                tasks = self.api("GET", f"/dags/{dag_id}/tasks", ok=(200, 404))
                if tasks and tasks.get("tasks"):
                    return dag
            time.sleep(1.0)
        raise AirflowError(f"DAG {dag_id} not parsed after {timeout:.0f} s\n{self.log_tails()}")

    def tasks(self, dag_id: str) -> dict[str, dict]:
        return {t["task_id"]: t for t in self.api("GET", f"/dags/{dag_id}/tasks")["tasks"]}

    def unpause(self, dag_id: str) -> None:
        self.api("PATCH", f"/dags/{dag_id}", {"is_paused": False})

    def trigger(self, dag_id: str, conf: dict, logical_date: str | None = None, run_id: str | None = None) -> str:
        body = {"logical_date": logical_date, "conf": conf}
        if run_id:
            body["dag_run_id"] = run_id
        return self.api("POST", f"/dags/{dag_id}/dagRuns", body)["dag_run_id"]

    def dag_runs(self, dag_id: str) -> list[dict]:
        """Every run of a DAG (triggered, scheduled or asset-triggered), oldest first."""
        return self.api("GET", f"/dags/{dag_id}/dagRuns", params={"limit": 100, "order_by": "id"})["dag_runs"]

    def dag_run(self, dag_id: str, run_id: str) -> dict:
        return self.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}")

    def wait_for_run(self, dag_id: str, run_id: str, timeout: float = 600, poll: float = 2.0) -> dict:
        """Poll until the run is success or failed; raises (with task states) when `timeout` runs out."""
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            run = self.dag_run(dag_id, run_id)
            if run["state"] in FINISHED:
                return run
            if time.monotonic() > deadline:
                raise AirflowError(
                    f"run {run_id} still {run['state']} after {timeout:.0f} s: "
                    f"{self.task_states(dag_id, run_id)}\n{self.log_tails()}"
                )
            time.sleep(poll)

    def task_instances(self, dag_id: str, run_id: str) -> list[dict]:
        return self.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances", params={"limit": 1000})[
            "task_instances"
        ]

    def task_states(self, dag_id: str, run_id: str) -> dict[tuple[str, str | None], str | None]:
        """(task_id, rendered map index or None) -> state; a mapped task's instances by their names."""
        out = {}
        for ti in self.task_instances(dag_id, run_id):
            name = None if ti["map_index"] < 0 else ti.get("rendered_map_index") or str(ti["map_index"])
            out[(ti["task_id"], name)] = ti["state"]
        return out

    def map_index(self, dag_id: str, run_id: str, task_id: str, rendered: str) -> int:
        found = [
            ti["map_index"]
            for ti in self.task_instances(dag_id, run_id)
            if ti["task_id"] == task_id and ti.get("rendered_map_index") == rendered
        ]
        if len(found) != 1:
            raise AirflowError(f"{task_id}[{rendered}]: {len(found)} task instances")
        return found[0]

    def xcom(self, dag_id: str, run_id: str, task_id: str, map_index: int = -1, key: str = "return_value"):
        """A task instance's XCom value, deserialised (JSON-able values come back as they were pushed)."""
        entry = self.api(
            "GET",
            f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/{key}",
            params={"map_index": map_index, "deserialize": True},
            ok=(200, 404),
        )
        if entry is None or "value" not in entry:
            return None
        value = entry["value"]
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                return json.loads(value)
        return value

    def clear(
        self, dag_id: str, run_id: str, task_ids: list, include_downstream: bool = True, only_failed: bool = False
    ) -> list[dict]:
        """Clear task instances (names or [task_id, map_index] pairs) of one run, so they run again."""
        body = {
            "dag_run_id": run_id,
            "task_ids": task_ids,
            "include_downstream": include_downstream,
            "only_failed": only_failed,
            "dry_run": False,
            "reset_dag_runs": True,
        }
        return self.api("POST", f"/dags/{dag_id}/clearTaskInstances", body)["task_instances"]

    def task_log(
        self, dag_id: str, run_id: str, task_id: str, map_index: int = -1, try_number: int | None = None
    ) -> str:
        """A task instance's log file (the latest try unless `try_number`), read from the log folder."""
        folder = self.home / "logs" / f"dag_id={dag_id}" / f"run_id={run_id}" / f"task_id={task_id}"
        if map_index >= 0:
            folder = folder / f"map_index={map_index}"
        tries = sorted(folder.glob("attempt=*.log"), key=lambda p: int(p.stem.split("=")[1]))
        if try_number is not None:
            tries = [p for p in tries if p.stem == f"attempt={try_number}"]
        return tries[-1].read_text(errors="replace") if tries else f"(no log under {folder})"

    def failed_logs(self, dag_id: str, run_id: str, chars: int = 4000) -> str:
        """The log tails of every failed task instance of a run (for assertion messages)."""
        out = []
        for ti in self.task_instances(dag_id, run_id):
            if ti["state"] == "failed":
                log = self.task_log(dag_id, run_id, ti["task_id"], ti["map_index"])
                out.append(f"--- {ti['task_id']}[{ti.get('rendered_map_index') or ti['map_index']}]\n{log[-chars:]}")
        return "\n".join(out)
