"""The functions Airflow's tasks call: job ids per date and dated URIs (backfills), and the outcome rule."""

import pytest

from pipeline import JobError
from pipeline.job.orchestrate import job_from_params, job_id_for, job_outcome
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


def test_outcome_fails_when_a_partition_did_not_commit():
    assert job_outcome({"partitions": {"p1": {"status": "succeeded"}}}) == "succeeded"
    with pytest.raises(JobError, match="1 of 2 partitions not committed: p2 failed"):
        job_outcome({"partitions": {"p1": {"status": "succeeded"}, "p2": {"status": "failed"}}})


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
