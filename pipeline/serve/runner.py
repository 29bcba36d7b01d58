"""The Batch API's runner: each batch is a tokenmill job, run one at a time by the server's own worker.

  validating   the input file counted against `serve.max_requests` and copied where its job reads it
  in_progress  `tokenmill run --job-id <batch id>` in a child process (its own engines; a kill loses nothing),
               or, with `serve.airflow`, a run of the nightly DAG on the Airflow deployment (its GPU workers)
  finalizing   a job stopped (or failed for good) ended with what it has; the result files its manifest
               names registered as API files
  completed | failed | cancelled | expired

The batch id is the job id, so a server restarted mid-batch runs the same job again and it continues
where it stopped, paying for nothing twice (the job's own exactly-once). One server per output root runs
batches: the holder of the runner lease (stores/runners.py); another serves the API only until the lease is
free. The child dies with the server (PR_SET_PDEATHSIG), and its process group is recorded in a pidfile, so
a server that claims the lease kills whatever a hard-killed server before it left running: never two runs of
one job side by side. Queued batches are taken from the tenants in turn (`next_turn`), each tenant's oldest.
Cancelling (or expiry) stops the child; then every partition of the job is committed with the answers it has
(job/lifecycle.py `end_stopped`), so what was paid for is returned, and the requests not answered are in the
error file (`batch_cancelled`, `batch_expired`). The runner is the one writer of batch objects once created;
the API only asks it to cancel.
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Literal, Protocol

import httpx
import yaml
from pydantic import SecretStr

from pipeline.config import TokenmillConfig, tokenmill_home
from pipeline.errors import JobError
from pipeline.job.lifecycle import Job
from pipeline.job.orchestrate import job_input
from pipeline.output.manifest import Manifest, read_manifest
from pipeline.serve.store import ACTIVE, MAX_ATTEMPTS, ApiStore, Batch
from pipeline.serve.validate import batch_errors, input_errors, request_lines
from pipeline.status import AT_BUDGET_CAP, PLANNING, JobStatus
from pipeline.stores import storage
from pipeline.stores.catalog import StateStore, migrate
from pipeline.stores.lease import Renewal, default_worker
from pipeline.stores.runners import RunnerLeases

log = logging.getLogger(__name__)

__all__ = ["ACTIVE", "MAX_ATTEMPTS", "BatchRunner", "job_config"]
MAX_FAULTS = 5  # passes in a row that fail on one batch (storage, catalog) before it is failed, unblocking the queue
JOB_FAILED = "the batch's job failed; the server's log names the cause (look for the batch id)"
WINDOWS = {"24h": 24 * 3600, "48h": 48 * 3600, "7d": 7 * 24 * 3600}  # completion windows the runner can time


def job_config(config: TokenmillConfig, store: ApiStore, batch: Batch) -> TokenmillConfig:
    """The job of a batch: the server's config, reading the batch's input as batch requests billed to its tenant
    (orchestrate.job_input, as a DAG run's tasks build theirs), with no progress bar."""
    job = job_input(
        config,
        store.out.uri(store.input_folder(batch.id)),
        batch.tenant,
        "anthropic" if batch.endpoint == "/v1/messages" else "openai",
    )
    return job.model_copy(update={"run": job.run.model_copy(update={"progress": "off"})})


class BatchRunner:
    def __init__(self, config: TokenmillConfig, store: ApiStore, workdir: Path | None = None):
        self.config, self.store = config, store
        self.workdir = workdir or Path(tokenmill_home()) / "serve"
        trigger = config.serve.airflow
        self.jobs: JobLauncher = AirflowRuns(trigger) if trigger is not None else ChildProcess(self.workdir)
        self.stop = threading.Event()
        self.faults: dict[str, int] = {}  # batch id -> passes in a row that raised on it
        self.stopping: dict[str, Job] = {}  # batch id -> its stopped job, while a partition's holder keeps it
        self.waiting: dict[str, float] = {}  # batch id -> since when it waits for such a holder (monotonic)
        self.last_tenant: str | None = None  # whose batch was taken last (tenants take turns)
        self.holder, self.epoch = default_worker(), None  # this server's claim of the runner lease, while held
        self.renewal: Renewal | None = None
        self.next_sweep = 0.0  # when the retention sweep runs next (monotonic)
        self.thread = threading.Thread(target=self._loop, name="batch-runner", daemon=True)

    def start(self) -> None:
        """Start running batches: the catalog brought to the latest schema first, once for the server's
        process (its passes and the jobs of its batches only read and write it)."""
        migrate(self.config.state.url, once=True)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.thread.start()

    def close(self) -> None:
        """Stop looking for work and stop the child (an Airflow run goes on): its batch stays `in_progress` and
        continues at the next start (here, or on a server that takes the released lease over)."""
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout=30)
        self.jobs.close()
        if self.epoch is not None:
            self.renewal.__exit__(None, None, None)
            self.leases.release(self.holder, self.epoch)

    def _loop(self) -> None:
        while not self.stop.is_set():
            moved = False
            try:
                if self.holds_lease():
                    moved = self.step()
                    self.sweep_files()
            except Exception:  # a fault of one pass (storage down): logged, the next pass tries again
                log.exception("batch runner")
            if not moved:  # a batch that moved may move again at once (its job launched, its results read)
                self.stop.wait(self.config.serve.poll_seconds)

    @functools.cached_property
    def leases(self) -> RunnerLeases:
        return RunnerLeases(self.state, self.store.out.uri(self.store.out.path))

    def holds_lease(self) -> bool:
        """Whether this server runs batches now: it holds its output root's runner lease, claimed on the first
        pass it is free. Claiming it kills what a server before it left running (a live orphan job: it would
        run beside the one started here); losing it (taken over while this server hung) stops this server's job."""
        seconds = self.config.state.lease_seconds
        if self.renewal is not None and self.renewal.lost:
            log.error(
                "the runner lease was taken over by %s: this server's job stops; it serves the API only",
                self.leases.holder(),
            )
            self.renewal.__exit__(None, None, None)
            self.renewal, self.epoch = None, None
            self.jobs.close()
        if self.epoch is None:
            self.epoch = self.leases.claim(self.holder, seconds)
            if self.epoch is None:
                return False
            active = self.store.index_active()  # (its own batches: servers of other roots may share the workdir)
            reaped = sum(self.jobs.reap(b.id) for b in self.store.active_batches())
            log.info(
                "runner lease claimed (epoch %d); %d orphan processes of an earlier server killed; %d active batches",
                self.epoch,
                reaped,
                active,
            )
            self.renewal = Renewal(lambda: self.leases.renew(self.holder, self.epoch, seconds), seconds, "runner-lease")
            self.renewal.__enter__()
        return True

    def step(self) -> bool:
        """One pass: end every active batch asked to cancel or past its window, wherever it is in the queue;
        then advance the one running, or else start the next in turn (one job at a time: one set of engines).
        Whether a batch moved."""
        active = self.store.active_batches()
        started = [b for b in active if b.status != "validating"]
        current = started[0] if started else self.next_turn([b for b in active if b.status == "validating"])
        now = int(time.time())
        ending = [b for b in active if b is not current and b.ending(now) is not None]
        moved = [self.guarded(batch) for batch in [*ending, *([current] if current is not None else [])]]
        return any(moved)

    def sweep_files(self, every: float = 3600) -> int:
        """Delete the files older than `serve.file_retention_days` (at most once every `every` seconds: it reads
        every file's metadata), except the input of an active batch. How many it deleted."""
        days = self.config.serve.file_retention_days
        if days is None or time.monotonic() < self.next_sweep:
            return 0
        self.next_sweep = time.monotonic() + every
        cutoff = time.time() - days * 86400
        in_use = {b.input_file_id for b in self.store.active_batches()}
        old = [f for f in self.store.all_files() if f["created_at"] < cutoff and f["id"] not in in_use]
        for meta in old:
            self.store.delete_file(meta)
        if old:
            log.info("%d files older than serve.file_retention_days (%s) deleted", len(old), days)
        return len(old)

    def next_turn(self, queued: list[Batch]) -> Batch | None:
        """The oldest queued batch of the tenant after the one taken last (tenants in turn, by name): a tenant
        that queued many batches gets one of every round, never the whole queue."""
        if not queued:
            return None
        tenants = sorted({b.tenant for b in queued})
        after = [t for t in tenants if self.last_tenant is not None and t > self.last_tenant]
        self.last_tenant = (after or tenants)[0]
        return next(b for b in queued if b.tenant == self.last_tenant)

    def guarded(self, batch: Batch) -> bool:
        """Advance `batch`; one that fails MAX_FAULTS passes in a row is failed, so it cannot block the queue.
        Whether it moved."""
        try:
            moved = self.advance(batch)
            self.faults.pop(batch.id, None)
            return moved
        except AirflowUnavailable as e:  # Airflow restarting or down: the batch did nothing wrong; asked again
            log.warning("batch %s: Airflow did not answer (%s); trying again", batch.id, e)
        except Exception:
            self.faults[batch.id] = n = self.faults.get(batch.id, 0) + 1
            log.exception("batch %s: pass %d failed", batch.id, n)
            if n >= MAX_FAULTS:
                try:
                    self.jobs.stop(batch)
                except Exception:  # failed all the same, so it cannot block the queue
                    log.exception("batch %s: its job could not be stopped", batch.id)
                batch.move("failed", int(time.time()), errors=batch_errors("job_failed", JOB_FAILED))
                self.write(batch)
                return True
        return False

    def advance(self, batch: Batch) -> bool:
        """Move `batch` one status on, and write it once when it moved (False: it stays as it was, its job
        running, or a partition of its stopped job held by a holder elsewhere):

          asked to cancel, or expired   its job stopped -> finalizing
          validating                    its input checked and copied -> in_progress | failed
          in_progress, no run           its job started (a child process, or an Airflow run)
          in_progress, run ended        -> finalizing, or in_progress to run again (Batch.after_run)
          finalizing                    its results become its files -> completed | cancelled | expired | failed
        """
        now = int(time.time())
        if batch.status != "finalizing" and batch.ending(now) is not None:
            if not self.jobs.stop(batch):  # its tasks are still ending: what they commit is returned too
                return False
            batch.stopped(now)
        elif batch.status == "validating":
            self.validate(batch, now)
        elif batch.status == "in_progress":
            if not self.jobs.runs(batch):
                batch.attempts += 1  # the job continues: after a restart, or a failed run
                self.jobs.start(batch, job_config(self.config, self.store, batch))
            elif (code := self.jobs.exit_code(batch)) is not None:
                self.jobs.forget(batch)
                job = self.state.job(batch.id)
                batch.after_run(code, job and job.status, now)
                if batch.status == "in_progress":
                    log.warning("batch %s: its job exited %d; running it again (it continues)", batch.id, code)
            else:
                return False  # its job runs
        elif not self.finish(batch, batch.ending(now) or "completed", now):  # finalizing
            return False
        self.write(batch)
        return True

    def write(self, batch: Batch) -> None:
        """The pass's one write of `batch`. Where it ended, what the server made for its job goes: its run's
        config here (`ended`, before the write: it holds secrets), then, once the batch says it ended, its
        input's copy and its job's staged records (`remove_copies_of`; a crash in between leaves copies that
        deleting the input file removes: `ApiStore.remove_copies`)."""
        ended = batch.status not in ACTIVE
        if ended:
            self.jobs.ended(batch)
        self.store.put_batch(batch)
        if ended:
            self.store.remove_copies_of(batch.id)

    def validate(self, batch: Batch, now: int) -> None:
        """Check its input (`validate.input_errors`); one that may run is copied where its job reads it."""
        meta = self.store.file(batch.tenant, batch.input_file_id)
        data = None if meta is None else self.store.content(meta)
        errors = input_errors(batch.input_file_id, data, batch.endpoint, self.config.serve)
        if errors is not None:
            batch.move("failed", now, errors=errors)
            return
        storage.write_bytes_atomic(self.store.out, self.store.input_file(batch.id), data)
        # Assigned, not changed in place: a batch writes only the fields set on it (`as_json`).
        batch.request_counts = batch.request_counts.model_copy(update={"total": request_lines(data)})
        batch.move("in_progress", now)

    def finish(self, batch: Batch, status: Literal["completed", "cancelled", "expired"], now: int) -> bool:
        """End a finalizing batch as `status`: its job, if it did not end by itself (`stopped_as`), is ended
        with what it has (job/lifecycle.py `end_stopped`: what was paid for is returned); then the result files its
        manifest names become the batch's files. False while a partition's holder elsewhere keeps its lease (see
        `return_what_was_paid`)."""
        job = self.state.job(batch.id)
        budget = job is not None and job.status in AT_BUDGET_CAP
        if budget:  # a budget cap (refused when it started, or deferred mid-run every time it ran): by how much
            batch.errors = batch_errors("budget_exceeded", job.error or "budget")
        # Whether its job may have answered: it began, and was not refused at a cap before it paid for anything.
        paid = job is not None and not (budget and not self.state.has_items(batch.id))
        stop = stopped_as(status, job, batch) if paid else None
        if stop is not None:
            config = job_config(self.config, self.store, batch)
            if not self.return_what_was_paid(batch, config, *stop):
                return False
        manifest = self.manifest(batch.id) if paid else None
        results = None if manifest is None else (manifest.batches or {}).get("input.jsonl")
        if results is None:  # its job never began, was refused before paying, or never finished planning
            if paid:
                log.error("batch %s: its job wrote no results; %s", batch.id, self.jobs.where_to_look(batch))
            ended = "failed" if budget or status == "completed" else status
            batch.unanswered(ended, now, batch.errors or _no_answer(status))
            return True
        files = {}
        for kind, key in (("output", "output_file_id"), ("errors", "error_file_id"), ("results", "output_file_id")):
            path = results["files"].get(kind)
            if path is None or getattr(batch, key) or key in files:
                continue
            size = self.store.out.fs.get_file_info(self.store.out.join(path)).size
            if size or kind != "errors":  # OpenAI sets no error file when nothing failed
                where, expiry = self.store.out.join(path), batch.output_expires_after
                meta = self.store.register_file(
                    batch.tenant, f"{batch.id}_{kind}.jsonl", "batch_output", where, size, None, expiry
                )
                files[key] = meta["id"]
        batch.answered(status, now, results, manifest.cost.cost_usd, **files)
        log.info("batch %s: %s, %s", batch.id, status, json.dumps(batch.request_counts.model_dump()))
        return True

    def manifest(self, job_id: str) -> Manifest | None:
        """The manifest the batch's job wrote as it ended (its `batches` name the result files), read, never
        written; None when it wrote none (its planning never finished)."""
        try:
            return read_manifest(self.store.out, job_id)
        except storage.StorageError:
            return None

    def return_what_was_paid(
        self, batch: Batch, config: TokenmillConfig, status: JobStatus, reason: str, detail: str
    ) -> bool:
        """Commit every partition of the batch's stopped job with the answers it has (job/lifecycle.py
        `end_stopped`; the rest quarantined as `reason`), write its manifest and set the job's status. False while
        a partition's holder elsewhere keeps its lease: the next pass tries again (the batch stays `finalizing`,
        shown as `cancelling` when cancelled), for at most two leases; then each pass counts as a fault."""
        job = self.stopping.get(batch.id) or Job.open(config, batch.id)
        left = job.end_stopped(status, detail, reason)
        failed = [p for p in left if p.status != "running"]
        waited = time.monotonic() - self.waiting.setdefault(batch.id, time.monotonic())
        if failed or waited > 2 * self.config.state.lease_seconds:  # a fault of this pass: MAX_FAULTS fail it
            p = (failed or left)[0]
            raise JobError(f"partition {p.partition} could not be committed: {p.status}: {p.last_error}")
        if left:
            self.stopping[batch.id] = job  # one catalog connection while it waits, not one per pass
            log.info("batch %s: %d partitions wait for their holders' leases to end", batch.id, len(left))
            return False
        self.stopping.pop(batch.id, None)
        self.waiting.pop(batch.id, None)
        return True

    @functools.cached_property
    def state(self) -> StateStore:
        """The jobs' catalog, opened once (opening one checks its schema)."""
        return StateStore(self.config.state.url)


class JobLauncher(Protocol):
    """How a batch's job runs: `tokenmill run` in a child process of the server (ChildProcess, the default), or a
    run of the nightly DAG on an Airflow deployment (AirflowRuns, `serve.airflow`). The runner speaks only this."""

    def runs(self, batch: Batch) -> bool:
        """Whether this launcher has a run of the batch's job under way (started here, or recorded on it)."""

    def start(self, batch: Batch, config: TokenmillConfig) -> None:
        """Start the batch's job with `config`, naming its run on the batch (the runner writes it next). A server
        stopped before that write starts the same run again on its next pass, never a second one beside it (the
        child's pidfile reaped; Airflow's run, of the same id, adopted)."""

    def exit_code(self, batch: Batch) -> int | None:
        """0 once the run succeeded, non-zero once it failed, None while it runs."""

    def forget(self, batch: Batch) -> None:
        """Drop what names the ended run, so that the next `start` begins another."""

    def stop(self, batch: Batch | None = None) -> bool:
        """Stop the batch's run (any, when None); True once nothing of it runs any more."""

    def reap(self, batch_id: str) -> int:
        """Kill what an earlier server left running for `batch_id`; how many processes."""

    def ended(self, batch: Batch) -> None:
        """The batch ended: remove what its run needed here (its config file)."""

    def close(self) -> None:
        """The server stops: stop what runs here (an Airflow run goes on)."""

    def where_to_look(self, batch: Batch) -> str:
        """Where the cause of a failed run is, for the server's log (never for the tenant)."""


class ChildProcess:
    """Each batch's job as `tokenmill run` in a child process of the server (the embedded default): one at a time."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.child: subprocess.Popen | None = None
        self.child_of: str | None = None  # the batch the child runs

    def runs(self, batch: Batch) -> bool:
        return self.child is not None and self.child_of == batch.id

    def start(self, batch: Batch, config: TokenmillConfig) -> None:
        self.stop()  # another batch's child, if any: one job (one set of engines) at a time
        self.reap(batch.id)  # one left by an earlier server, if any survived: never two runs of a job
        path = self.workdir / f"{batch.id}.yaml"
        # The config whole, its secrets expanded: readable by this user alone, deleted when the batch ends.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
        command = [sys.executable, "-m", "pipeline.cli", "run", "--config", str(path), "--job-id", batch.id]
        # The config is whole in the file: no TOKENMILL_* override of the server's environment applies twice.
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_") or k == "TOKENMILL_HOME"}
        self.spawn(batch.id, command, env)
        log.info("batch %s: job started (pid %d)", batch.id, self.child.pid)

    def spawn(self, batch_id: str, command: list[str], env: dict | None = None) -> None:
        """Start `command` as the child running `batch_id`, dying with this server, its process group in a pidfile."""
        out = open(self.workdir / f"{batch_id}.log", "ab")  # noqa: SIM115 (the child holds it)
        self.child = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own process group, its engines' processes in it: found and killed as one
            preexec_fn=functools.partial(_die_with_parent, os.getpid()),
        )
        self.child_of = batch_id
        out.close()
        self._pidfile(batch_id).write_text(json.dumps({"pid": self.child.pid, "started": _started(self.child.pid)}))

    def exit_code(self, batch: Batch) -> int | None:
        return self.child.poll() if self.runs(batch) else None

    def forget(self, batch: Batch) -> None:
        self._pidfile(batch.id).unlink(missing_ok=True)
        self.child, self.child_of = None, None

    def stop(self, batch: Batch | None = None) -> bool:
        """Stop the child (only when it runs `batch`, if given; else whatever an earlier server left running
        `batch`); True: it has ended."""
        if batch is not None and self.child_of != batch.id:
            self.reap(batch.id)
            return True
        if self.child is not None and self.child.poll() is None:
            os.killpg(self.child.pid, signal.SIGTERM)  # the child and its engines' processes
            try:
                self.child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.child.pid, signal.SIGKILL)
                self.child.wait()
        if self.child is not None:
            kill_group(self.child.pid, None)  # an engine process that outlived its job's SIGTERM
            self._pidfile(self.child_of).unlink(missing_ok=True)
        self.child, self.child_of = None, None
        return True

    def reap(self, batch_id: str) -> int:
        """Kill the process group that an earlier server's pidfile of `batch_id` records: a job left running by
        a server that was hard-killed (its engines, if the job itself died). Only by batch: servers of other
        output roots may share this folder. How many processes were killed."""
        path = self._pidfile(batch_id)
        if self.child_of == batch_id:
            return 0  # this server's own child
        try:
            recorded = json.loads(path.read_text())
        except (OSError, ValueError):
            return 0
        killed = kill_group(recorded["pid"], recorded.get("started"))
        path.unlink(missing_ok=True)
        return killed

    def _pidfile(self, batch_id: str) -> Path:
        return self.workdir / f"{batch_id}.pid"

    def ended(self, batch: Batch) -> None:
        (self.workdir / f"{batch.id}.yaml").unlink(missing_ok=True)

    def close(self) -> None:
        self.stop()

    def where_to_look(self, batch: Batch) -> str:
        """The last line of the batch's job log, for the server's log (never for the tenant: it may name paths)."""
        try:
            last = (self.workdir / f"{batch.id}.log").read_text(errors="replace").strip().splitlines()[-1]
            return f"its log: {last[:1000]}"
        except (OSError, IndexError):
            return "its job wrote no log"


class AirflowUnavailable(RuntimeError):
    """Airflow's API did not answer (down, restarting, a 5xx): not the batch's fault; asked again next pass."""


class AirflowRefused(RuntimeError):
    """Airflow answered a call with a 4xx (other than 401 and 404, which `call` handles): `status` says which."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def check(response, what: str) -> None:
    """Airflow's answer `response` to `what`: AirflowUnavailable for a 5xx, AirflowRefused for any other refusal."""
    if response.status_code >= 500:
        raise AirflowUnavailable(f"{what}: {response.status_code}")
    if response.status_code >= 300:
        raise AirflowRefused(response.status_code, f"Airflow {what}: {response.status_code} {response.text[:500]}")


class AirflowToken(httpx.Auth):
    """Airflow's JWT as an httpx auth flow: fetched from `POST /auth/token` before the first call, sent as a
    bearer, and fetched again once when a call is refused (401: it expired); a second 401 is the call's answer."""

    requires_response_body = True  # the token is in the body of the login's answer

    def __init__(self, url: str, username: str, password: SecretStr):
        self.url, self.username, self.password = url, username, password
        self.token: str | None = None

    def auth_flow(self, request: httpx.Request):
        if self.token is None:
            yield from self.login()
        request.headers["Authorization"] = f"Bearer {self.token}"
        response = yield request
        if response.status_code == 401:
            yield from self.login()
            request.headers["Authorization"] = f"Bearer {self.token}"
            yield request

    def login(self):
        body = {"username": self.username, "password": self.password.get_secret_value()}
        response = yield httpx.Request("POST", self.url, json=body)
        check(response, "POST /auth/token")
        self.token = response.json()["access_token"]


class AirflowRuns:
    """Each batch's job as a run of the nightly DAG on Airflow (`serve.airflow`), through its REST API: the
    deployment's GPU workers run it, this server only triggers, watches and stops it. The run's id follows
    from the batch (its id and attempt number, as written), so a server restarted at any moment watches (or
    adopts) that same run instead of starting another."""

    ACTIVE_TASKS = ("scheduled", "queued", "running", "restarting", "up_for_retry", "up_for_reschedule", "deferred")

    def __init__(self, trigger, transport=None):
        """`transport`: an httpx transport in place of the network (tests)."""
        self.trigger = trigger
        base = trigger.url.rstrip("/")
        auth = AirflowToken(f"{base}/auth/token", trigger.username, trigger.password)
        self.client = httpx.Client(base_url=base, timeout=trigger.timeout_seconds, transport=transport, auth=auth)

    def call(self, method: str, path: str, body: dict | None = None, params: dict | None = None) -> dict | None:
        """One REST call under /api/v2, with the JWT that `AirflowToken` keeps; None for a 404. Raises
        AirflowUnavailable when Airflow does not answer, answers 5xx or refuses a fresh token."""
        try:
            r = self.client.request(method, f"/api/v2{path}", json=body, params=params)
        except httpx.TransportError as e:
            raise AirflowUnavailable(f"{type(e).__name__}: {e}") from None
        if r.status_code == 401:
            raise AirflowUnavailable("Airflow refused a fresh token")
        if r.status_code == 404:
            return None
        check(r, f"{method} {path}")
        return r.json() if r.content else {}

    def runs(self, batch: Batch) -> bool:
        return batch.airflow_run is not None

    def start(self, batch: Batch, config: TokenmillConfig) -> None:
        """Name the run on the batch, with the job's params, and create it. The runner writes the batch after:
        a server stopped in between left the batch as it read it, so the next pass names the same run (its
        attempt number is the batch's) and `create` adopts it."""
        batch.airflow_run = f"tokenmill-batch-{batch.id}-{batch.attempts}"
        batch.airflow_conf = {
            "config": self.trigger.config,
            "input_uri": config.input.uri,
            "output_uri": config.output.uri,
            "job_id": batch.id,
            "tenant": batch.tenant,
            "input_format": config.input.format,
        }
        self.create(batch)

    def create(self, batch: Batch) -> None:
        path = f"/dags/{self.trigger.dag_id}/dagRuns"
        body = {"dag_run_id": batch.airflow_run, "logical_date": None, "conf": batch.airflow_conf}
        try:
            self.call("POST", path, body)
        except AirflowRefused as e:
            if e.status != 409:  # 409: a run of that id exists (created before a restart): it is this batch's
                raise
            log.info("batch %s: Airflow run %s exists already: watching it", batch.id, batch.airflow_run)
            return
        log.info("batch %s: job started as Airflow run %s of %s", batch.id, batch.airflow_run, self.trigger.dag_id)

    def state(self, batch: Batch) -> str | None:
        run = self.call("GET", f"/dags/{self.trigger.dag_id}/dagRuns/{batch.airflow_run}")
        return None if run is None else run["state"]

    def exit_code(self, batch: Batch) -> int | None:
        """0 when the run succeeded, 1 when it failed, None while it is queued or running. A run Airflow does not
        have (deleted, or lost as Airflow restarted) is created again: the job continues."""
        state = self.state(batch)
        if state is None:
            self.create(batch)
            return None
        return {"success": 0, "failed": 1}.get(state)

    def forget(self, batch: Batch) -> None:
        batch.airflow_run, batch.airflow_conf = None, None

    def stop(self, batch: Batch | None = None) -> bool:
        """Fail the batch's run (Airflow then stops its tasks; what they paid for stays paid). True once none
        of its tasks runs any longer, so that what is returned is all the run will commit."""
        if batch is None or not self.runs(batch):
            return True
        state = self.state(batch)
        if state in ("queued", "running"):
            self.call("PATCH", f"/dags/{self.trigger.dag_id}/dagRuns/{batch.airflow_run}", {"state": "failed"})
        elif state is None:
            return True
        path = f"/dags/{self.trigger.dag_id}/dagRuns/{batch.airflow_run}/taskInstances"
        tasks = (self.call("GET", path, params={"limit": 1000}) or {}).get("task_instances", [])
        return not any(t["state"] in self.ACTIVE_TASKS for t in tasks)

    def ended(self, batch: Batch) -> None:
        pass

    def reap(self, batch_id: str) -> int:
        return 0  # the runs are Airflow's: a restarted server watches them, nothing of them runs here

    def close(self) -> None:
        self.client.close()

    def where_to_look(self, batch: Batch) -> str:
        return f"its Airflow run {batch.airflow_run} of {self.trigger.dag_id}: see its failed tasks' logs"


PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded before any fork: the child only calls into it


def _die_with_parent(parent: int) -> None:
    """In the child, before it runs `tokenmill run`: SIGKILL when the server's thread that started it ends
    (the runner's, which lives as long as the server), so a hard-killed server leaves no job running; one
    whose server died before this line exits at once."""
    _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def _stat(pid: int) -> tuple[str, int, int] | None:
    """A process's state, process group and start time (clock ticks after boot), from /proc; None: none runs."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except (OSError, ValueError):
        return None
    return fields[0], int(fields[2]), int(fields[19])


def _started(pid: int) -> int | None:
    stat = _stat(pid)
    return None if stat is None else stat[2]


def kill_group(group: int, started: int | None) -> int:
    """SIGKILL every process of the process group `group` (its leader was started at `started`, when known), and
    wait until they are gone. A group whose leader runs with another start time is another's (the pid was
    reused): left alone. A pid is never reused while a process of its group lives, so the members of a group
    whose leader died are its own. How many processes were killed."""
    leader = _stat(group)
    if leader is not None and started is not None and leader[2] != started:
        return 0

    def members() -> list[int]:
        pids = (int(p) for p in os.listdir("/proc") if p.isdigit())
        return [p for p in pids if (st := _stat(p)) is not None and st[1] == group and st[0] != "Z"]

    found = members()
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 30
    while members() and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(found)


def stopped_as(status: str, job, batch: Batch) -> tuple[JobStatus, str, str] | None:
    """How a finalizing batch's job is ended, when it did not end by itself: (the job's status, and the reason and
    detail of each request it did not answer). None: it ended by itself (its manifest written), or it never planned
    (its partitions do not exist). `status`: how the batch ends (`completed` unless cancelled or expired)."""
    if job.status in (*PLANNING, "succeeded"):
        return None
    if job.status in AT_BUDGET_CAP:  # stopped at a budget cap after paying for some
        return job.status, "budget_exceeded", job.error or "budget"
    if status != "completed":
        return status, status, f"the batch was {status} before this request was answered"
    if batch.failed_for_good():
        return "failed", "not_run", "the batch's job failed before this request was answered"
    return None


def _no_answer(status: str) -> dict | None:
    """The errors of a batch that ends with no answer as `status`: a completed one failed, its job's fault."""
    return batch_errors("job_failed", JOB_FAILED) if status == "completed" else None
