"""The Batch API's runner as a process among others (pipeline/serve/runner.py): its job dies with it, a server
that takes over kills what a hard-killed one left, one server per output root runs batches, tenants take turns,
the runner finds its work through the index of active batches, and reads a finished job's results without
writing any of the job's files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from fastapi.testclient import TestClient

from pipeline.serve.access import key_digest
from pipeline.serve.app import create_app
from pipeline.serve.runner import BatchRunner, ChildProcess, kill_group
from pipeline.serve.store import ApiStore, Batch
from pipeline.stores import storage
from pipeline.stores.catalog import migrate
from tests.conftest import REPO

SERVER = """
import sys, time
from pathlib import Path
from pipeline.serve.runner import ChildProcess
jobs = ChildProcess(Path(sys.argv[1]))
# The job: a process that starts an engine-like grandchild of its own, then works for a long time.
jobs.spawn("batch-orphan", [sys.executable, "-c", "import subprocess, time; subprocess.Popen(['sleep', '600']); "
                            "print('engine started', flush=True); time.sleep(600)"])
print(jobs.child.pid, flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def until(condition, what: str, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def group(pgid: int) -> list[int]:
    def pgid_of(pid: str) -> int | None:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return int(f.read().rpartition(")")[2].split()[2])
        except (OSError, ValueError):
            return None

    return [int(p) for p in os.listdir("/proc") if p.isdigit() and pgid_of(p) == pgid and alive(int(p))]


@pytest.mark.parametrize("then", ["the next server claims the root", "the batch is cancelled after a restart"])
def test_a_hard_killed_servers_job_dies_with_it_and_what_is_left_is_killed(runner_for, tmp_path, then):
    runner = runner_for()  # the server started again, on the same host and $TOKENMILL_HOME
    runner.store.put_batch(batch(0, "acme", "in_progress", id="batch-orphan"))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(runner.workdir)], stdout=subprocess.PIPE, env=env, text=True
    )
    child = int(server.stdout.readline())
    until(lambda: (runner.workdir / "batch-orphan.log").read_text().startswith("engine started"), "the job's engine")
    assert len(group(child)) == 2  # the job and its engine
    try:
        server.send_signal(signal.SIGKILL)  # the server OOM-killed: no handler of it runs
        server.wait()
        until(lambda: not alive(child), "the job outlived its server")
        assert len(group(child)) == 1  # its engine, a process of the job's own, is left ...
        if then == "the next server claims the root":
            assert runner.holds_lease()  # ... and killed before the restarted server runs anything
        else:
            assert ChildProcess(runner.workdir).stop(runner.store.batch(None, "batch-orphan")) is True
        assert group(child) == [] and not (runner.workdir / "batch-orphan.pid").exists()
    finally:
        kill_group(child, None)


def test_a_process_group_whose_leader_is_another_process_now_is_left_alone(tmp_path):
    other = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        assert kill_group(other.pid, started=1) == 0 and alive(other.pid)  # recorded with another start time
    finally:
        other.kill()
        other.wait()


@pytest.fixture
def runner_for(make_config, tmp_path):
    runners = []

    def make(**overrides) -> BatchRunner:
        config = make_config(**overrides)
        migrate(config.state.url)  # what `start` does first: these tests drive the runner's passes themselves
        runner = BatchRunner(config, ApiStore(storage.resolve(config.output.uri)), tmp_path / "serve")
        (tmp_path / "serve").mkdir(exist_ok=True)
        runners.append(runner)
        return runner

    yield make
    for runner in runners:
        runner.close()


def batch(n: int, tenant: str, status: str = "validating", **fields) -> Batch:
    return Batch(
        **{"id": f"batch-{n}", "input_file_id": "file-0", **fields},
        tenant=tenant,
        status=status,
        created_at=1000 + n,
        expires_at=2**40,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )


def test_one_server_per_output_root_runs_batches_and_another_takes_over_when_it_stops(runner_for):
    first, second = runner_for(), runner_for()
    assert first.holds_lease() and not second.holds_lease()  # the second serves the API only
    assert not second.holds_lease()
    first.close()  # releases the lease
    assert second.holds_lease()


def test_tenants_take_turns_and_the_runner_reads_only_the_active_batches(runner_for):
    runner = runner_for()
    store = runner.store
    for n, tenant in enumerate(["acme", "acme", "acme", "globex"]):
        store.put_batch(batch(n, tenant))
    store.put_batch(batch(9, "acme", "completed"))
    taken = []

    def run_to_its_end(b: Batch) -> None:  # stands in for the batch's job
        taken.append(b.id)
        b.status = "completed"
        store.put_batch(b)

    runner.guarded = run_to_its_end
    for _ in range(5):
        runner.step()
    assert taken == ["batch-0", "batch-3", "batch-1", "batch-2"]  # globex's one batch does not wait for acme's three
    assert store.active_batches() == [] and os.listdir(os.path.join(store.out.path, "_api", "active")) == []


def test_the_index_survives_a_crash_between_its_writes_and_is_rebuilt_from_the_batches(runner_for):
    store = runner_for().store
    store.put_batch(batch(1, "acme"))
    ended = batch(2, "acme", "failed").as_json()
    store.put_batch(batch(2, "acme"))
    storage.write_bytes_atomic(store.out, store.out.join("_api", "batches", "batch-2.json"), json.dumps(ended).encode())
    assert [b.id for b in store.active_batches()] == ["batch-1"]  # the ended one's entry is dropped
    store.out.fs.delete_dir_contents(store.out.join("_api", "active"))  # an output root from before the index
    assert store.active_batches() == [] and store.index_active() == 1
    assert [b.id for b in store.active_batches()] == ["batch-1"]


def test_a_tenant_over_its_cap_of_active_batches_is_refused_and_others_are_not(make_config):
    keys = {"acme": "tm-a", "globex": "tm-g"}
    tenants = {f"tenants__{name}": {"api_keys": [key_digest(key)]} for name, key in keys.items()}
    config = make_config(serve__max_active_batches=2, **tenants)
    store = ApiStore(storage.resolve(config.output.uri))
    client = TestClient(create_app(config, store))

    def create(tenant: str):
        headers = {"Authorization": f"Bearer {keys[tenant]}"}
        file = client.post(
            "/v1/files", headers=headers, files={"file": ("b.jsonl", b"{}\n")}, data={"purpose": "batch"}
        )
        body = {"input_file_id": file.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        return client.post("/v1/batches", headers=headers, json=body)

    first, _ = create("acme"), create("acme")
    refused = create("acme")
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "too_many_batches"
    assert create("globex").status_code == 200
    done = store.batch(None, first.json()["id"])
    done.status = "completed"
    store.put_batch(done)
    assert create("acme").status_code == 200  # one ended: room again


def test_files_past_their_retention_are_deleted_except_an_active_batchs_input(runner_for):
    runner = runner_for(serve__file_retention_days=1)
    store = runner.store
    old, recent, in_use = (store.add_file("acme", f"{n}.jsonl", "batch", b"{}\n") for n in ("old", "recent", "used"))
    for meta in (old, in_use):  # uploaded two days ago
        storage.write_bytes_atomic(
            store.out,
            store.out.join("_api", "files", f"{meta['id']}.json"),
            json.dumps({**meta, "created_at": meta["created_at"] - 2 * 86400}).encode(),
        )
    store.put_batch(batch(1, "acme", input_file_id=in_use["id"]))
    assert runner.sweep_files() == 1 and runner.sweep_files() == 0  # once an hour at most
    assert store.file("acme", old["id"]) is None
    assert store.file("acme", recent["id"]) and store.file("acme", in_use["id"])
    assert not os.path.exists(os.path.join(store.out.path, "_api", "files", f"{old['id']}.jsonl"))


def test_both_job_launchers_speak_the_one_protocol():
    """The runner speaks only JobLauncher: the child process and the Airflow run implement every method of it,
    with its parameters."""
    import inspect

    from pipeline.serve.runner import AirflowRuns, JobLauncher

    methods = [n for n, f in vars(JobLauncher).items() if inspect.isfunction(f) and not n.startswith("_")]
    assert len(methods) == 9
    for launcher in (ChildProcess, AirflowRuns):
        for name in methods:
            want = list(inspect.signature(getattr(JobLauncher, name)).parameters)
            assert list(inspect.signature(getattr(launcher, name)).parameters) == want, (launcher.__name__, name)


def test_a_finished_jobs_results_are_read_from_its_manifest_and_nothing_of_the_job_is_written(runner_for, monkeypatch):
    """Finalizing a batch whose job ended by itself reads the manifest the job wrote (output.manifest), and writes
    only the batch and its files' metadata under `_api/`: never the job's manifest or result files."""
    from types import SimpleNamespace

    from pipeline.output.manifest import Manifest, ManifestCost
    from pipeline.output.write import write_manifest

    runner = runner_for()
    out, done = runner.store.out, batch(1, "acme", "finalizing", request_counts={"total": 2})
    files = {
        "output": "batches/job=batch-1/input.jsonl.output.jsonl",
        "errors": "batches/job=batch-1/input.jsonl.errors.jsonl",
    }
    for path, body in zip(files.values(), (b'{"custom_id": "a"}\n', b"")):
        storage.write_bytes_atomic(out, out.join(path), body)
    results = {"files": files, "request_counts": {"total": 2, "completed": 1, "failed": 1}, "models": ["gpt-4o-mini"]}
    results["usage"] = {"prompt_tokens": 7, "cached_prompt_tokens": 2, "output_tokens": 3}
    cost = ManifestCost(cost_usd=0.5)
    manifest = Manifest(job_id="batch-1", status="succeeded", cost=cost, batches={"input.jsonl": results})
    write_manifest(out, "batch-1", manifest)
    runner.state = SimpleNamespace(job=lambda _: SimpleNamespace(status="succeeded", error=None), has_items=bool)
    written = []
    monkeypatch.setattr(storage, "write_bytes_atomic", lambda root, path, data: written.append(path))

    assert runner.advance(done)
    assert done.status == "completed" and done.request_counts.completed == 1 and done.cost_usd == 0.5
    assert done.usage["total_tokens"] == 10 and done.usage["input_tokens_details"] == {"cached_tokens": 2}
    assert done.output_file_id and done.error_file_id is None  # OpenAI sets no error file when nothing failed
    assert written and all("/_api/" in path for path in written), written


def test_a_batch_write_writes_only_the_batch_and_the_runner_removes_an_ended_batchs_copies(runner_for):
    """`put_batch` writes the batch and its index entry, nothing else; where a batch ends, the runner removes
    the copy of its input its job read and the job's staged records (`remove_copies_of`), the client's upload
    kept."""
    from pipeline.stores.staging import StagingArea

    runner = runner_for()
    store = runner.store
    upload = store.add_file("acme", "b.jsonl", "batch", b"{}\n")
    copies = store.input_folder("batch-1")
    staged = StagingArea(store.out, "batch-1")

    def copy_made() -> None:
        storage.write_bytes_atomic(store.out, store.input_file("batch-1"), b"{}\n")
        staged.write_plan({"partitions": []})

    copy_made()
    store.put_batch(batch(1, "acme", "failed", input_file_id=upload["id"]))
    assert os.path.exists(copies) and staged.plan() == {"partitions": []}  # a write of the batch only

    ended = batch(1, "acme", input_file_id="file-missing")  # its input gone: it fails as it is validated
    store.put_batch(ended)
    assert runner.advance(ended) and store.batch(None, "batch-1").status == "failed"
    assert not os.path.exists(copies) and store.file("acme", upload["id"]) is not None
    with pytest.raises(storage.StorageError):
        staged.plan()


def test_every_read_of_an_active_batch_carries_its_cancel_request_and_both_apis_show_it(make_config):
    """The store reads a batch with whether it was asked to cancel, one batch or a tenant's list; both APIs show a
    batch asked to cancel as cancelling (OpenAI) or canceling (Anthropic), as they answer the cancel and as they
    list it, without reading the request themselves."""
    config = make_config(tenants__acme={"api_keys": [key_digest("tm-a")]})
    store = ApiStore(storage.resolve(config.output.uri))
    client = TestClient(create_app(config, store))
    openai_, anthropic = {"Authorization": "Bearer tm-a"}, {"x-api-key": "tm-a", "anthropic-version": "2023-06-01"}
    file = client.post("/v1/files", headers=openai_, files={"file": ("b.jsonl", b"{}\n")}, data={"purpose": "batch"})
    body = {"input_file_id": file.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    chat = client.post("/v1/batches", headers=openai_, json=body).json()["id"]
    request = {
        "custom_id": "a",
        "params": {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
    }
    message = client.post("/v1/messages/batches", headers=anthropic, json={"requests": [request]}).json()["id"]
    assert not any(b.cancel_requested for b in store.batches("acme"))

    assert client.post(f"/v1/batches/{chat}/cancel", headers=openai_).json()["status"] == "cancelling"
    cancel = client.post(f"/v1/messages/batches/{message}/cancel", headers=anthropic).json()
    assert cancel["processing_status"] == "canceling"
    assert store.batch("acme", chat).cancel_requested and store.batch("acme", message).cancel_requested
    assert all(b.cancel_requested for b in store.batches("acme"))
    assert [b["status"] for b in client.get("/v1/batches", headers=openai_).json()["data"]] == ["cancelling"] * 2
    listed = client.get("/v1/messages/batches", headers=anthropic).json()["data"]
    assert [b["processing_status"] for b in listed] == ["canceling"]
