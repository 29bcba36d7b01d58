"""A Batch API batch's moves from status to status (pipeline/serve/store.py `Batch`): decided on the object
alone, no storage or catalog read, each value checked as it is set; the runner writes the batch once after."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pipeline.serve.store import MAX_ATTEMPTS, Batch

NEW = {"id": "batch-1", "tenant": "acme", "endpoint": "/v1/chat/completions", "input_file_id": "file-1"}


def _batch(**fields) -> Batch:
    """A batch in progress, created at 0, its window over at 100."""
    times = {"completion_window": "24h", "status": "in_progress", "created_at": 0, "expires_at": 100}
    return Batch.model_validate(NEW | times | fields)


def test_a_run_that_fails_runs_again_until_max_attempts_and_a_refused_job_does_not():
    batch = _batch()
    for run in range(1, MAX_ATTEMPTS):
        batch.after_run(1, "running", now=run)
        assert (batch.status, batch.failed_runs) == ("in_progress", run)
    batch.after_run(1, "running", now=9)
    assert (batch.status, batch.finalizing_at, batch.failed_for_good()) == ("finalizing", 9, True)
    refused = _batch()
    refused.after_run(1, "refused", now=5)  # it would be refused again
    assert (refused.status, refused.failed_runs, refused.failed_for_good()) == ("finalizing", 1, False)
    succeeded = _batch(failed_runs=2)
    succeeded.after_run(0, "succeeded", now=5)
    assert (succeeded.status, succeeded.failed_runs) == ("finalizing", 2)


def test_a_cancel_comes_before_expiry_and_its_time_is_kept_once():
    assert _batch().ending(now=99) is None
    assert _batch().ending(now=100) == "expired"
    cancelled = _batch(cancel_requested=True)
    assert cancelled.ending(now=100) == "cancelled"
    cancelled.stopped(now=7)
    cancelled.stopped(now=8)  # a restarted server stops it again: the time the cancel was seen stays
    assert (cancelled.status, cancelled.cancelling_at, cancelled.finalizing_at) == ("finalizing", 7, 8)
    expired = _batch()
    expired.stopped(now=100)
    assert expired.cancelling_at is None


def test_an_unanswered_batch_fails_every_request_and_its_time_is_named_by_its_status():
    batch = _batch(request_counts={"total": 4, "completed": 1})
    batch.unanswered("cancelled", now=3)
    assert batch.request_counts.model_dump() == {"total": 4, "completed": 0, "failed": 4}
    assert (batch.status, batch.cancelled_at, batch.errors) == ("cancelled", 3, None)
    assert batch.ended_at() == 3


def test_a_wrong_status_is_refused_where_it_is_set_and_the_cancel_request_is_never_written():
    batch = _batch(cancel_requested=True)
    with pytest.raises(ValidationError):
        batch.move("done", now=1)
    assert "cancel_requested" not in batch.as_json() and "cancel_requested" not in batch.model_dump()
