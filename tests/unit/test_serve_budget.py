"""The budget check in `POST /v1/batches` (pipeline/serve/app.py BudgetCheck) around its estimate: whom it
applies to, what it compares, and what happens when the estimate cannot be made or is already running."""

from __future__ import annotations

import threading
import time

import pytest

from pipeline.serve import app
from pipeline.serve.app import ApiError, BudgetCheck
from pipeline.serve.store import Batch

BATCH = Batch(
    id="batch_1",
    tenant="acme",
    endpoint="/v1/chat/completions",
    input_file_id="file-1",
    completion_window="24h",
    status="validating",
    created_at=0,
    expires_at=86400,
)
FILE = b'{"custom_id": "r1"}\n\n{"custom_id": "r2"}\n'


def estimate(busy: dict[str, float]) -> dict:
    return {"tenants_busy_usd": busy, "est_usd_low": 0.0, "est_usd_high": 1.0, "to_generate": 2, "cache_hits": 0}


@pytest.fixture
def check(make_config, monkeypatch):
    def make(result, **overrides):
        calls = []

        def fake(config, input_uri=None, cached=False):
            calls.append((input_uri, cached))
            if isinstance(result, Exception):
                raise result
            return result

        monkeypatch.setattr(app, "estimate_job", fake)
        monkeypatch.setattr(app, "job_config", lambda config, store, batch: config)
        return BudgetCheck(make_config(**overrides), store=None), calls

    return make


def test_only_a_tenant_with_a_cap_is_estimated(check):
    budget, _ = check(estimate({}), budget__max_tenant_usd={"acme": 1.0})
    assert budget.applies("acme") and not budget.applies("globex")
    budget, _ = check(estimate({}), budget__max_job_usd=1.0)
    assert budget.applies("globex")
    budget, _ = check(estimate({}), budget__max_job_usd=1.0, serve__estimate_max_requests=0)
    assert not budget.applies("acme")


def test_over_the_cap_by_the_guards_figure_is_refused_with_the_estimate(check):
    budget, calls = check(estimate({"acme": 2.0}), budget__max_tenant_usd={"acme": 1.0})
    with pytest.raises(ApiError) as refused:
        budget.check(BATCH, FILE)
    assert refused.value.status == 400 and refused.value.code == "budget_exceeded"
    assert "tenant acme $2.000000 > its cap $1.000000" in refused.value.message
    assert calls and calls[0][1] is True  # exact cache hits are looked up
    budget, _ = check(estimate({"acme": 0.5}), budget__max_tenant_usd={"acme": 1.0})
    budget.check(BATCH, FILE)  # under: created


def test_a_failed_estimate_creates_the_batch_and_a_large_file_is_not_estimated(check, caplog):
    budget, _ = check(RuntimeError("no tokenizer"), budget__max_tenant_usd={"acme": 1.0})
    budget.check(BATCH, FILE)  # the job's own check applies when it starts
    assert "no budget estimate in the call" in caplog.text
    budget, calls = check(estimate({"acme": 2.0}), budget__max_tenant_usd={"acme": 1.0}, serve__estimate_max_requests=1)
    budget.check(BATCH, FILE)  # 2 requests > 1: left to the job
    assert calls == []


def test_a_tenants_estimate_never_holds_up_another_tenant_and_its_own_queue_is_bounded(check):
    """One estimate at a time per tenant, a bounded number of its creates waiting; other tenants go on."""
    budget, calls = check(estimate({"acme": 0.0, "globex": 0.0}), budget__max_job_usd=1.0, serve__estimate_queue=1)
    globex = BATCH.model_copy(update={"tenant": "globex"})
    with budget.queue.turn("acme"):  # acme's estimate in progress
        waiting = threading.Thread(target=budget.check, args=(BATCH, FILE))
        waiting.start()  # acme's next create waits for its turn ...
        while budget.queue.queued["acme"] < 2:
            time.sleep(0.01)
        with pytest.raises(ApiError) as busy:  # ... and one more is over the bound
            budget.check(BATCH, FILE)
        assert busy.value.status == 429 and busy.value.code == "estimate_busy"
        budget.check(globex, FILE)  # another tenant is estimated meanwhile
        assert len(calls) == 1  # globex's: acme's waiting create has not been estimated yet
    waiting.join()
    assert len(calls) == 2 and budget.queue.queued == {"acme": 0, "globex": 0}
