"""The functions Airflow's tasks call: job ids per date and dated URIs (backfills), and the outcome rule."""

import pytest

from pipeline import JobError
from pipeline.job.orchestrate import job_from_params, job_id_for, job_outcome
from pipeline.output.manifest import Manifest
from tests.conftest import TINY_CONFIG


def test_each_date_is_its_own_job_with_dated_uris(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path))
    params = {
        "config": str(TINY_CONFIG),
        "input_uri": "s3://in/{date}/",
        "output_uri": str(tmp_path / "out"),
        "run_date": None,
    }
    jobs = {d: job_from_params(params, "nightly_summarization", d) for d in ("2026-11-01", "2026-11-02")}
    assert {j for _, j in jobs.values()} == {"nightly_summarization-2026-11-01", "nightly_summarization-2026-11-02"}
    assert jobs["2026-11-02"][0].input.uri == "s3://in/2026-11-02/"
    config, job_id = job_from_params({**params, "run_date": "2026-10-31"}, "nightly_summarization", "2026-11-02")
    assert job_id.endswith("2026-10-31") and config.input.uri == "s3://in/2026-10-31/"
    assert job_id_for("a b", "2026/11/01") == "a-b-2026-11-01"


def test_a_batch_api_run_names_its_job_tenant_and_format(tmp_path, monkeypatch):
    """What `tokenmill serve` passes when it triggers the DAG for a batch (serve.airflow)."""
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path))
    params = {"config": str(TINY_CONFIG), "job_id": "batch_0123abcd", "tenant": "acme", "input_format": "openai"}
    config, job_id = job_from_params(params, "nightly_summarization", None)  # a run with no logical date
    assert job_id == "batch_0123abcd"
    assert (config.input.default_tenant, config.input.request_tenant, config.input.format) == (
        "acme",
        "default",
        "openai",
    )
    with pytest.raises(JobError, match="is not valid"):
        job_from_params({**params, "job_id": "../other"}, "nightly_summarization", None)


def test_outcome_fails_when_a_partition_did_not_commit():
    job = {"job_id": "j", "status": "incomplete"}
    assert job_outcome({**job, "partitions": {"p1": {"status": "succeeded"}}}) == "succeeded"
    with pytest.raises(JobError, match="1 of 2 partitions not committed: p2 failed"):
        job_outcome({**job, "partitions": {"p1": {"status": "succeeded"}, "p2": {"status": "failed"}}})


@pytest.mark.parametrize("job_id", ["nl\n", "a\nb", "", "-lead", "x" * 129, "sp ace", "job=x"])
def test_a_job_id_is_checked_whole(job_id):
    """Reproducer (red team): `$` matched before a final newline, so `nl\\n` was accepted and made `job=nl\\n`
    folders that `rerun --job-id nl` could not find."""
    from pipeline.job.context import check_job_id

    with pytest.raises(JobError, match="must be 1-128 characters"):
        check_job_id(job_id)


def test_valid_job_ids_pass():
    from pipeline.job.context import check_job_id, new_job_id

    for job_id in ("a", "nightly_summarization-2026-11-01", "x" * 128, new_job_id()):
        check_job_id(job_id)


def test_a_gpu_worker_refuses_a_drain_of_a_tier_it_does_not_serve(monkeypatch):
    from pipeline.job.drain import WORKER_TIERS_ENV, check_worker_serves

    monkeypatch.delenv(WORKER_TIERS_ENV, raising=False)
    check_worker_serves("large")  # unset: a host that serves every tier (the embedded default)
    monkeypatch.setenv(WORKER_TIERS_ENV, "small, medium")
    check_worker_serves("small")
    check_worker_serves("medium")
    with pytest.raises(JobError, match=r"serves tiers small, medium .* tier 'large'.*gpu-small and gpu-medium"):
        check_worker_serves("large")


def test_table_assets_name_the_tables_physical_folders_and_each_update_names_its_job(tmp_path, monkeypatch):
    from pipeline.job.orchestrate import TABLES, table_asset_uri, table_asset_uris, table_updates

    assert [table_asset_uri("s3://summaries/out/", t) for t in TABLES] == [
        "s3://summaries/out/outputs",
        "s3://summaries/out/ledger",
        "s3://summaries/out/quarantine",
    ]
    assert table_asset_uri("file:///data/out", "ledger") == "file:///data/out/ledger"
    monkeypatch.chdir(tmp_path)  # a relative root is where the job's storage puts it: under the working directory
    assert table_asset_uri("./out", "ledger") == f"file://{tmp_path}/out/ledger"
    assert table_asset_uri("s3://summaries/{date}", "outputs") == "s3://summaries/{date}/outputs"
    with pytest.raises(ValueError, match="no table 'items'"):
        table_asset_uri("s3://summaries/out", "items")
    # At the DAG's parse time, from `output.uri` alone: its environment override and ${VAR}s, no other secret.
    config = tmp_path / "prod.yaml"
    config.write_text("output: {uri: 's3://${BUCKET}/nightly/{date}'}\nstate: {url: '${TOKENMILL_PG_DSN}'}\n")
    monkeypatch.setenv("BUCKET", "summaries")
    monkeypatch.delenv("TOKENMILL_OUTPUT__URI", raising=False)
    assert table_asset_uris(config)["ledger"] == "s3://summaries/nightly/{date}/ledger"
    monkeypatch.setenv("TOKENMILL_OUTPUT__URI", str(tmp_path / "out"))
    assert table_asset_uris(config)["quarantine"] == f"file://{tmp_path}/out/quarantine"
    manifest = {
        "job_id": "nightly-2026-12-01",
        "output_uri": "s3://summaries/out",
        "status": "incomplete",
        "counts": {"outputs": 7, "quarantined": 2},
        "cost": {"cost_usd": 0.25, "gpu_seconds": 90.0},
        "partitions": {"a": {"status": "succeeded"}, "b": {"status": "failed"}},
    }
    updates = table_updates(Manifest.parse(manifest))
    assert set(updates) == set(TABLES)
    assert all(
        u["job_id"] == "nightly-2026-12-01" and u["output_uri"] == "s3://summaries/out" for u in updates.values()
    )
    assert all(u["partitions_committed"] == 1 and u["partitions"] == 2 for u in updates.values())
    assert updates["outputs"]["rows"] == 7 and updates["quarantine"]["rows"] == 2
    assert updates["ledger"]["cost_usd"] == 0.25 and updates["ledger"]["gpu_seconds"] == 90.0


def test_lineage_names_datasets_by_the_openlineage_naming_spec():
    from pipeline.job.lineage import dataset_name, summary_lineage

    assert dataset_name("/data/in/2026-12-01") == ("file", "/data/in/2026-12-01")
    assert dataset_name("file:///data/in") == ("file", "/data/in")
    assert dataset_name("s3://incoming/2026-12-01/") == ("s3://incoming", "2026-12-01/")
    manifest = {
        "job_id": "j",
        "status": "incomplete",
        "input_uri": "s3://incoming/day",
        "output_uri": "s3://summaries/tokenmill/",
        "counts": {"records": 10, "outputs": 7, "quarantined": 3},
        "cost": {"cost_usd": 0.5, "gpu_seconds": 60.0},
        "partitions": {"a": {"status": "succeeded"}, "b": {"status": "failed"}},
    }
    lineage = summary_lineage(Manifest.parse(manifest))
    assert [(d.namespace, d.name) for d in lineage["inputs"]] == [("s3://incoming", "day")]
    assert [d.name for d in lineage["outputs"]] == ["tokenmill/outputs", "tokenmill/ledger", "tokenmill/quarantine"]
    rows = [(d.outputFacets or {}).get("outputStatistics") for d in lineage["outputs"]]
    assert [r.rowCount if r else None for r in rows] == [7, None, 3]
    facet = lineage["run_facets"]["tokenmill_job"]
    assert (facet.partitions, facet.partitionsCommitted, facet.costUsd) == (2, 1, 0.5)


def test_a_batch_job_and_a_dag_run_set_their_input_in_one_place(tmp_path):
    """The Batch API's runner and the DAG's tasks build a job's input the same way (orchestrate.job_input):
    billed to the tenant, every request's tenant the batch's, the format forced; the server's config untouched."""
    from pipeline.config import load_config
    from pipeline.job.orchestrate import job_config, job_input
    from pipeline.serve.runner import job_config as batch_job_config
    from pipeline.serve.store import ApiStore, Batch
    from pipeline.stores import storage
    from tests.conftest import TINY_CONFIG

    server = load_config(TINY_CONFIG)
    before = server.model_dump(mode="json")
    store = ApiStore(storage.resolve(str(tmp_path / "out")))
    asked = Batch(
        id="batch-1",
        tenant="acme",
        endpoint="/v1/messages",
        input_file_id="file-1",
        completion_window="24h",
        status="in_progress",
        created_at=0,
        expires_at=86400,
    )
    batch = batch_job_config(server, store, asked)
    dag = job_config(str(TINY_CONFIG), "2026-12-07", input_uri="in-{date}", tenant="acme", input_format="anthropic")
    for job in (batch, dag):
        assert (job.input.default_tenant, job.input.request_tenant, job.input.format) == (
            "acme",
            "default",
            "anthropic",
        )
    assert dag.input.uri == "in-2026-12-07" and batch.input.uri.endswith("batch-1")
    assert batch.run.progress == "off" and server.model_dump(mode="json") == before
    assert job_input(server, "x").input.default_tenant == server.input.default_tenant  # no tenant: as configured
