"""The Batch API's Airflow runner (`serve.airflow`, pipeline/serve/runner.py AirflowRuns) against a scripted
Airflow REST API (httpx.MockTransport): what it does when Airflow is down, answers 5xx, forgets a run, refuses
a token, or keeps tasks running after a cancel. The happy path on a real deployment is
tests/system/test_airflow_batch.py."""

from __future__ import annotations

import json

import httpx
import pytest

from pipeline.config import AirflowTriggerConfig
from pipeline.serve.runner import MAX_FAULTS, AirflowRuns, AirflowUnavailable, BatchRunner
from pipeline.serve.store import Batch

RUN = "tokenmill-batch-batch-1-1"
RUN_PATH = f"/api/v2/dags/nightly_summarization/dagRuns/{RUN}"


class FakeAirflow:
    """Airflow's REST API as far as the runner uses it: tokens, runs, their task instances."""

    def __init__(self):
        self.runs: dict[str, dict] = {}
        self.tasks: list[dict] = []
        self.calls: list[tuple[str, str]] = []
        self.down = False  # connection refused
        self.status: int | None = None  # every call answers this instead
        self.stale_tokens = 0  # tokens refused (401) before one is taken

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.calls.append((request.method, request.url.path))
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if self.status is not None:
            return httpx.Response(self.status, json={"detail": "scripted"})
        if request.url.path == "/auth/token":
            return httpx.Response(201, json={"access_token": "t"})
        if self.stale_tokens:
            self.stale_tokens -= 1
            return httpx.Response(401, json={"detail": "token expired"})
        path, method = request.url.path, request.method
        if method == "POST" and path.endswith("/dagRuns"):
            run_id = json.loads(request.content)["dag_run_id"]
            if run_id in self.runs:
                return httpx.Response(409, json={"detail": "exists"})
            self.runs[run_id] = {"dag_run_id": run_id, "state": "queued"}
            return httpx.Response(200, json=self.runs[run_id])
        run_id = path.split("/dagRuns/")[-1].split("/")[0]
        if run_id not in self.runs:
            return httpx.Response(404, json={"detail": "not found"})
        if path.endswith("/taskInstances"):
            return httpx.Response(200, json={"task_instances": self.tasks})
        if method == "PATCH":
            self.runs[run_id]["state"] = "failed"
        return httpx.Response(200, json=self.runs[run_id])


def _trigger() -> AirflowTriggerConfig:
    return AirflowTriggerConfig(url="http://airflow:8080", username="u", password="s3cret", config="/c.yaml")


@pytest.fixture
def airflow():
    return FakeAirflow()


def _runs(airflow) -> AirflowRuns:
    return AirflowRuns(_trigger(), transport=httpx.MockTransport(airflow))


def _batch(attempts: int = 1, **fields) -> Batch:
    return Batch(
        id="batch-1",
        tenant="acme",
        attempts=attempts,
        endpoint="/v1/chat/completions",
        input_file_id="file-1",
        completion_window="24h",
        status="in_progress",
        created_at=0,
        expires_at=2**40,
        **fields,
    )


class _Config:
    class input:  # noqa: N801 (the config's shape)
        uri, format = "s3://out/_api/inputs/batch-1", "openai"

    class output:  # noqa: N801
        uri = "s3://out"


def test_start_creates_the_run_and_watching_creates_it_only_when_airflow_lost_it(airflow):
    runs, batch = _runs(airflow), _batch()
    runs.start(batch, _Config)  # named on the batch (the runner writes it) and created
    assert batch.airflow_run == RUN and batch.airflow_conf["tenant"] == "acme"
    assert set(airflow.runs) == {RUN} and [c for c in airflow.calls if c[0] == "POST" and "dagRuns" in c[1]]
    assert runs.exit_code(batch) is None
    airflow.down = True  # Airflow down as it is watched: asked again next pass
    with pytest.raises(AirflowUnavailable):
        runs.exit_code(batch)
    # Back, having lost the run (its database restored): watching it creates it again, once.
    airflow.down, airflow.runs = False, {}
    assert runs.runs(batch) and runs.exit_code(batch) is None and set(airflow.runs) == {RUN}
    runs.create(batch)  # created twice (a 409): adopted, not an error
    assert set(airflow.runs) == {RUN}
    airflow.runs[RUN]["state"] = "success"
    assert runs.exit_code(batch) == 0


def test_a_server_stopped_before_it_wrote_the_run_it_created_adopts_it(make_config, airflow, tmp_path):
    """The runner writes a batch once a pass, after its run is created: a server stopped in between left the
    batch as it was read; the next pass names the same run (its attempt number is the batch's), and Airflow's
    409 adopts it: never two runs of one job."""
    from pipeline.serve.store import ApiStore
    from pipeline.stores import storage
    from pipeline.stores.catalog import migrate

    config = make_config(serve__airflow=_trigger().model_dump() | {"password": "s3cret"})
    migrate(config.state.url)
    store = ApiStore(storage.resolve(str(tmp_path / "out")))
    runner = BatchRunner(config, store, tmp_path / "serve")
    runner.jobs = _runs(airflow)
    store.put_batch(_batch(attempts=0, request_counts={"total": 1}))
    written = store.put_batch
    store.put_batch = lambda batch: (_ for _ in ()).throw(OSError("the server stopped"))
    with pytest.raises(OSError):
        runner.advance(store.batch(None, "batch-1"))
    assert set(airflow.runs) == {RUN} and store.batch(None, "batch-1").airflow_run is None
    store.put_batch = written
    assert runner.advance(store.batch(None, "batch-1"))
    again = store.batch(None, "batch-1")
    assert again.airflow_run == RUN and again.attempts == 1 and set(airflow.runs) == {RUN}


def test_an_expired_token_is_fetched_again_and_the_password_never_shows(airflow):
    runs, batch = _runs(airflow), _batch()
    runs.start(batch, _Config)
    airflow.stale_tokens = 1
    assert runs.exit_code(batch) is None
    assert [c for c in airflow.calls if c[1] == "/auth/token"] == [("POST", "/auth/token")] * 2
    assert "s3cret" not in repr(_trigger()) and "s3cret" not in _trigger().model_dump_json()
    airflow.stale_tokens = 2  # refused again with a fresh token: Airflow's fault, asked again next pass
    with pytest.raises(AirflowUnavailable, match="fresh token"):
        runs.exit_code(batch)
    assert [c for c in airflow.calls if c[1] == "/auth/token"] == [("POST", "/auth/token")] * 3


def test_a_cancel_waits_until_the_runs_tasks_have_ended(airflow):
    runs, batch = _runs(airflow), _batch()
    runs.start(batch, _Config)
    airflow.runs[RUN]["state"] = "running"
    airflow.tasks = [{"task_id": "commit", "state": "running"}, {"task_id": "prepare", "state": "success"}]
    assert runs.stop(batch) is False and airflow.runs[RUN]["state"] == "failed"  # failed, its commit still ending
    assert ("PATCH", RUN_PATH) in airflow.calls
    airflow.tasks[0]["state"] = "failed"
    assert runs.stop(batch) is True
    assert [c for c in airflow.calls if c[0] == "PATCH"] == [("PATCH", RUN_PATH)]  # failed once


def test_airflow_down_is_not_the_batchs_fault_but_a_refusing_airflow_fails_it(make_config, airflow, tmp_path):
    from pipeline.serve.store import ApiStore
    from pipeline.stores import storage
    from pipeline.stores.catalog import migrate

    config = make_config(serve__airflow=_trigger().model_dump() | {"password": "s3cret"})
    migrate(config.state.url)  # what the runner's `start` does first: this test drives its passes itself
    store = ApiStore(storage.resolve(str(tmp_path / "out")))
    runner = BatchRunner(config, store, tmp_path / "serve")
    runner.jobs = _runs(airflow)
    batch = _batch(request_counts={"total": 1})
    runner.jobs.start(batch, _Config)  # its run is on Airflow, running
    airflow.runs[RUN]["state"] = "running"
    store.put_batch(batch)
    airflow.down = True
    for _ in range(MAX_FAULTS + 2):  # Airflow restarting: the batch waits, however long
        runner.guarded(batch)
    assert store.batch(None, "batch-1").status == "in_progress" and not runner.faults
    airflow.down, airflow.status = False, 403  # a refusal that will not pass: failed, and the queue moves on
    for _ in range(MAX_FAULTS):
        runner.guarded(batch)
    failed = store.batch(None, "batch-1")
    assert failed.status == "failed" and failed.errors["data"][0]["code"] == "job_failed"
