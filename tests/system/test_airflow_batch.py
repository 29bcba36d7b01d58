"""The Batch API on the production topology: with `serve.airflow`, each batch is a run of the nightly DAG on a
real Airflow deployment (tests/airflow_deploy.py), triggered through Airflow's REST API, instead of a child
process of the server. The same openai SDK calls, the same answers; the run is the batch's job (its id is the
batch id), billed to the caller's tenant."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.serve.access import key_digest
from tests.airflow_deploy import AirflowDeployment
from tests.conftest import TINY_CONFIG
from tests.integration.test_batch_files import batch_lines
from tests.nightly_dag import DAG_ID, deployment, tokenmill_env
from tests.system.test_batch_api import KEYS, Server, batch_file, lines_of, submit, wait_for

pytestmark = pytest.mark.airflow_deploy


@pytest.fixture
def airflow(tmp_path, tiny_models, static_embedder, postgres_admin_url):
    env = {
        **tokenmill_env(tmp_path, 10_000, {"small": 1, "large": 1}),
        # What the server's own config says too: the model name the requests ask for, no shadow checks.
        "TOKENMILL_TIERS__SMALL__SERVED_MODEL_NAMES": json.dumps(["gpt-4o-mini"]),
        "TOKENMILL_DEDUP__SHADOW_RATE": "0",
    }
    with deployment(tmp_path, postgres_admin_url, env, {"small": 1, "large": 1}) as af:
        yield af


def test_a_batch_runs_as_a_run_of_the_nightly_dag_on_airflow(airflow: AirflowDeployment, make_config, tmp_path):
    trigger = {
        "url": airflow.url,
        "username": airflow.USER,
        "password": airflow.password,
        "config": str(TINY_CONFIG),  # on the workers, with their environment: the same catalog and output root
    }
    config = make_config(
        tiers__small__served_model_names=["gpt-4o-mini"],
        dedup__shadow_rate=0,
        tenants__acme={"api_keys": [key_digest(KEYS["acme"])]},
        serve__airflow=trigger,
        serve__validation="lenient",  # the file's lines OpenAI refuses become error lines, as in test_batch_api
    )
    with Server(config, tmp_path / "serve") as server:
        client = server.client()
        batch = submit(client, batch_file(tmp_path, batch_lines()))
        done = wait_for(client, batch.id, ("completed", "failed"))
        output, errors = lines_of(client, done.output_file_id), lines_of(client, done.error_file_id)
    assert done.status == "completed", done.errors

    # The batch's job ran as an Airflow run of the DAG, under the batch's id, and its drains did the GPU work.
    run_id = f"tokenmill-batch-{batch.id}-1"
    states = airflow.task_states(DAG_ID, run_id)
    assert airflow.dag_run(DAG_ID, run_id)["state"] == "success", (states, airflow.failed_logs(DAG_ID, run_id))
    assert states[("drain_small", "small 0")] == "success", states
    assert airflow.xcom(DAG_ID, run_id, "summary")["job_id"] == batch.id

    # The same answers as the child-process runner gives (tests/system/test_batch_api.py), billed to the caller.
    assert len(output) + len(errors) == len(batch_lines()) and done.request_counts.completed == len(output) == 6
    rows = pq.read_table(Path(config.output.uri) / "outputs").to_pylist()
    summaries = {r["id"]: r["summary"] for r in rows}
    assert {r["tenant"] for r in rows} == {"acme"}
    for line in output:
        choice = line["response"]["body"]["choices"][0]
        assert (choice.get("message") or {}).get("content", choice.get("text")) == summaries[line["custom_id"]]
    assert done.model_extra["tokenmill"]["cost_usd"] > 0
