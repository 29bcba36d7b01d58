"""Pre-flight estimates and budget caps: refuse before GPU work, stop cleanly mid-run, defer, resume."""

import json
import sqlite3
import subprocess
import sys

import pytest

from pipeline import JobError, run_job
from pipeline.stores.catalog import StateStore, migrate
from tests.conftest import FAKE_ENGINE, ONE_TIER, REPO, TINY_CONFIG, read_kind
from tests.jobs import assert_exactly_once


def items_paid(config, job_id):
    from sqlalchemy import text

    with StateStore(config.state.url).db_session() as s:
        return s.execute(text("select count(*) from items where job_id = :j"), {"j": job_id}).scalar()


def test_job_over_budget_is_refused_before_any_gpu_work(make_config, sample_corpus, tmp_path):
    config = make_config(budget__max_job_usd=1e-9)
    with pytest.raises(JobError) as e:
        run_job(config, job_id="refused")
    assert e.value.budget and "refused before any GPU work" in str(e.value)
    assert "budget.max_job_usd" in str(e.value) and "configured default" in str(e.value)
    assert items_paid(config, "refused") == 0
    assert not (tmp_path / "output" / "outputs").exists()
    assert StateStore(config.state.url).job("refused").status == "refused"


def test_tenant_cap_refuses_naming_the_tenant(make_config, sample_corpus):
    config = make_config(budget__max_tenant_usd={"acme": 1e-9})
    with pytest.raises(JobError, match="tenant acme .* > its cap"):
        run_job(config, job_id="tenant-cap")


def test_spending_crossing_the_cap_stops_cleanly_and_the_rest_is_deferred(make_config, sample_corpus, tmp_path):
    expected = sample_corpus[1]["documents"] + sample_corpus[1]["bad_records"]
    # A near-zero estimate lets the job start; what the engine really spends then crosses the cap.
    config = make_config(budget__max_job_usd=1e-9, tiers__small__default_tokens_per_gpu_second=1e12)
    with pytest.raises(JobError) as e:
        run_job(config, job_id="capped")
    assert e.value.budget and "budget reached" in str(e.value) and "deferred, nothing lost" in str(e.value)
    state = StateStore(config.state.url)
    parts = state.partitions("capped")
    deferred = [p for p in parts if p.status == "deferred"]
    assert deferred and all(p.status in ("deferred", "succeeded") for p in parts)
    assert state.job("capped").status == "deferred"
    with sqlite3.connect(tmp_path / "state.db") as c:  # under a cap a worker runs one unit at a time
        done = c.execute(
            "select count(*), sum(requests) from work_units where job_id='capped' and status='done'"
        ).fetchone()
    assert done[0] == 1 and items_paid(config, "capped") == done[1]  # exactly one unit was admitted
    manifest = json.loads((tmp_path / "output" / "jobs" / "capped" / "manifest.json").read_text())
    assert manifest["counts"]["deferred_records"] == sum(p.records for p in deferred)
    committed = manifest["counts"]["outputs"] + manifest["counts"]["quarantined"]
    assert committed + manifest["counts"]["deferred_records"] == expected  # every record accounted for

    # Raise the cap and run the rest: what was generated before the stop is not paid again.
    run_job(make_config(), job_id="capped")
    assert {p.status for p in state.partitions("capped")} == {"succeeded"}
    assert_exactly_once(tmp_path / "output", "capped", sample_corpus[1], tmp_path / "state.db")


# Shadow verification generates a sampled near/semantic reuse anyway and keeps that output when it differs
# (a false hit): with random tiny models whether it differs varies with the batch, and with it how many
# items the run paid for against the estimate's count. Off here, where the counts are the point.
NO_SHADOW = {"TOKENMILL_DEDUP__SHADOW_RATE": "0"}


def test_plan_estimates_then_learns_from_ledgers(make_config, sample_corpus, tiny_models, tmp_path):
    import os

    env = {
        **os.environ,
        "TOKENMILL_HOME": str(tiny_models.parent),
        "TOKENMILL_OUTPUT__URI": str(tmp_path / "output"),
        "TOKENMILL_BUDGET__MAX_JOB_USD": "1e-9",
        **ONE_TIER,
        **NO_SHADOW,
        **FAKE_ENGINE,
    }

    def plan():
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "pipeline.cli",
                "estimate",
                "--config",
                str(TINY_CONFIG),
                "--input",
                str(sample_corpus[0]),
                "--format",
                "json",
            ],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr[-1500:]
        return json.loads(r.stdout)

    before = plan()
    assert before["records"] == sample_corpus[1]["documents"] + sample_corpus[1]["bad_records"]
    assert (
        before["duplicates"] > 0
        and before["to_generate"] + before["duplicates"] + before["quarantined"] == before["records"]
    )
    assert before["tiers"]["small"]["share"] == 1.0 and before["est_usd"] > 0
    assert before["tiers"]["small"]["method"].startswith("configured default")
    assert before["budget_problems"] and "budget.max_job_usd" in before["budget_problems"][0]
    # No history: the configured throughput ×1/4 to ×4, up to max_tokens of output, and an engine start-up and
    # idle of 0-60 s priced at its middle; the tier's line says so.
    small, price = before["tiers"]["small"], make_config().tiers["small"].price_per_gpu_hour / 3600
    assert "×0.25-×4" in small["method"] and "start-up and idle 0-60 s" in small["method"]
    assert small["engine_overhead"] == pytest.approx(
        {"gpu_seconds": 30.0, "est_usd": 30 * price, "est_usd_low": 0.0, "est_usd_high": 60 * price}
    )
    busy = before["est_usd"] - 30 * price
    assert before["est_usd_high"] == pytest.approx(4 * busy + 60 * price) and before["est_usd_low"] < busy / 4
    assert "err high" not in before["note"] and "Not counted" in before["note"]

    config = make_config(dedup__shadow_rate=0)
    run_job(config, job_id="history")
    after = plan()
    assert after["tiers"]["small"]["method"].startswith("measured: ")
    ledger = [r for r in read_kind(tmp_path / "output", "ledger", "history").to_pylist() if r["source"] == "generated"]
    actual = sum(r["cost_usd"] for r in ledger)
    # The midpoint is this very ledger's busy GPU-seconds per weighted token times the estimate's own weights
    # (prompt tokens at the measured prefix-cache share), plus the engine start-up and idle it measured; those
    # weights differ from the ledger's only by which copy of a duplicate group is the one generated.
    c, small, price = config.cost, after["tiers"]["small"], config.tiers["small"].price_per_gpu_hour / 3600

    def weight(prompt, cached, output):
        return (
            c.prefill_token_weight * (prompt - cached) + c.cached_token_weight * cached + c.decode_token_weight * output
        )

    actual_weight = sum(weight(r["prompt_tokens"], r["cached_prompt_tokens"], r["output_tokens"]) for r in ledger)
    cached_share = sum(r["cached_prompt_tokens"] for r in ledger) / sum(r["prompt_tokens"] for r in ledger)
    estimated_weight = weight(small["prompt_tokens"], cached_share * small["prompt_tokens"], small["est_output_tokens"])
    busy, overhead = (sum(r[k] for r in ledger) for k in ("busy_gpu_seconds", "overhead_gpu_seconds"))
    assert overhead > 0 and small["engine_overhead"]["gpu_seconds"] == pytest.approx(overhead, rel=1e-9)
    assert after["est_usd"] == pytest.approx((busy / actual_weight * estimated_weight + overhead) * price, rel=1e-6)
    assert after["to_generate"] == small["items"] == len(ledger)
    assert small["est_output_tokens"] == pytest.approx(sum(r["output_tokens"] for r in ledger), rel=1e-9)
    assert small["prompt_tokens"] == pytest.approx(sum(r["prompt_tokens"] for r in ledger), rel=0.02)
    # Start-up and idle now count per engine, not per token, so the same corpus again costs what it did.
    assert after["est_usd"] == pytest.approx(actual, rel=0.05)
    assert after["est_usd_low"] < actual < after["est_usd_high"] < 4 * after["est_usd_low"]


def test_price_demand_adds_escalations_and_each_engines_start_up(make_config):
    from pipeline.plan.estimate import Demand, price_demand
    from pipeline.plan.rates import Measured, Range, TierRate

    config = make_config(routing=True)  # small escalates to large

    def rate(spw, out, escalation, overhead):
        return TierRate(
            spw,
            out,
            "test",
            Range(spw / 2, spw, spw * 2),
            Range(0.0, 0.0, 0.0),
            Measured(out, 100, 0.0, (out,), (0.0, 48.0)),
            escalation,
            Range(*overhead),
        )

    rates = {
        "small": rate(1e-3, 40.0, Measured(0.25, 100, None, (0.25,), (0.0, 1.0)), (10.0, 20.0, 30.0)),
        "large": rate(4e-3, 48.0, None, (5.0, 10.0, 15.0)),
    }
    demand = Demand()
    demand.add(["small"] * 4 + ["large"], [100] * 4 + [200], ["a", "a", "b", "b", "a"])
    est = price_demand(demand, config, rates)
    c, usd = config.cost, {t: config.tiers[t].price_per_gpu_hour / 3600 for t in rates}
    small = 1e-3 * (c.prefill_token_weight * 400 + c.decode_token_weight * 40 * 4) * usd["small"]
    escalated = 0.25 * 4e-3 * (c.prefill_token_weight * 400 + c.decode_token_weight * 48 * 4) * usd["large"]
    large = 4e-3 * (c.prefill_token_weight * 200 + c.decode_token_weight * 48) * usd["large"]
    assert est["tiers"]["small"]["est_usd"] == pytest.approx(small + 20 * usd["small"])
    assert est["tiers"]["small"]["escalation"]["est_usd"] == pytest.approx(escalated)
    assert est["tiers"]["large"]["est_usd"] == pytest.approx(escalated + large + 10 * usd["large"])
    assert est["est_usd"] == pytest.approx(small + escalated + large + 20 * usd["small"] + 10 * usd["large"])
    assert est["tiers"]["small"]["escalation"]["items"] == est["tiers"]["large"]["escalated_in"]["items"] == 1.0
    assert sum(est["tenants"].values()) == pytest.approx(est["est_usd"])
    assert sum(r["est_usd_high"] for r in est["tenant_ranges"].values()) == pytest.approx(est["est_usd_high"])
    assert est["est_usd_low"] < est["est_usd"] < est["est_usd_high"]
    # Only escalations on large, and none expected at the midpoint: its engine starts only at the high end.
    demand = Demand()
    demand.add(["small"] * 4, [100] * 4, ["a"] * 4)
    rates["small"] = rate(1e-3, 40.0, Measured(0.0, 100, None, (0.0,), (0.0, 1.0)), (10.0, 20.0, 30.0))
    large = price_demand(demand, config, rates)["tiers"]["large"]
    assert large["est_usd"] == 0.0 and large["engine_overhead"]["est_usd_high"] == pytest.approx(15 * usd["large"])


def test_a_tier_whose_history_is_only_long_documents_is_priced_not_crashed(make_config):
    """Reproducer: a tier that routing sent only chunked documents has no plain row to measure its
    output length on; the estimate and the budget guard crashed with a TypeError. Its output length falls
    back to the configured range, and its throughput is still the measured one."""
    import pyarrow as pa

    from pipeline.plan.estimate import estimate_usd
    from pipeline.plan.rates import Range, rates_from_history

    config = make_config()
    model = config.tiers["small"].generator
    # job, partition, tier, model, items, busy, overhead, prompt, cached, output, plain items, their output, its
    # square, prices
    pure = [("j1", "p1", "small", model, 3, 2.0, 5.0, 3000, 0, 150, 0, None, None, 0.5, 0.5)]
    rate = rates_from_history(config, pure, [])["small"]
    assert rate.method.startswith("measured: ")
    top = config.sampling.max_tokens
    assert rate.output.predict(10) == Range(1.0, top, top)  # 1 to max_tokens, as with no ledger
    [usd] = estimate_usd(pa.array(["small"]), pa.array([100]), config, {"small": rate})
    assert usd > 0


def test_estimate_from_one_job_holds_the_next_corpus_escalations_included(make_config, sample_corpus, tmp_path):
    """After one real job with routing and escalation, the estimate of another corpus (new documents, a cache of
    its own so nothing is reused) predicts its escalations and a range holding what it then costs. Each job
    starts and releases its engines, as `tokenmill run` does (an engine kept from the job before would make the
    second job's start-up free)."""
    from pipeline import estimate_job
    from pipeline.dev.samples import write_sample_corpus

    # Engine steps take 0.1 ms per token they process, so engine time follows the work in proportion to the
    # ledger's token weights (a fake step with no time would leave start-up noise to dominate the cost, and one
    # of fixed time would price a step of one request like a step of sixty-four).
    stepped = {f"tiers__{t}__fake__token_seconds": 1e-4 for t in ("small", "large")}
    run_job(make_config(routing=True, dedup__shadow_rate=0, **stepped), job_id="first", release_engines=True)
    first = [r for r in read_kind(tmp_path / "output", "ledger", "first").to_pylist() if r["source"] == "generated"]
    escalated = sum(bool(r["escalated"]) for r in first)
    from_small = escalated + sum(r["tier"] == "small" and r["attempts"] == 1 for r in first)
    assert 0 < escalated < from_small  # the tiny models escalate some, not all: the rate is measured, not 0 or 1

    write_sample_corpus(tmp_path / "second", documents=40, seed=12)
    config = make_config(
        tmp_path / "second", routing=True, dedup__shadow_rate=0, cache__path=str(tmp_path / "cache2"), **stepped
    )
    est = estimate_job(config)
    esc = est["tiers"]["small"]["escalation"]
    assert esc["rate"] == pytest.approx(escalated / from_small)
    assert esc["items"] == pytest.approx(esc["rate"] * est["tiers"]["small"]["items"])
    assert est["tiers"]["large"]["escalated_in"]["items"] == pytest.approx(esc["items"])
    assert all(t["method"].startswith("measured: ") for t in est["tiers"].values())

    run_job(config, job_id="second", release_engines=True)
    second = [r for r in read_kind(tmp_path / "output", "ledger", "second").to_pylist() if r["source"] == "generated"]
    assert len(second) == est["to_generate"]  # nothing reused from the first job: the estimate's count holds
    # Which items escalate is a hash of each request (the fake engine): the same on every run, but another corpus
    # escalates another share, which is why the cost range, not the count, is the promise.
    assert 0.5 < esc["items"] / sum(bool(r["escalated"]) for r in second) < 2
    # Not a vacuous range (one job of history: start-up and idle ±50%, the escalation rate's binomial interval),
    # and the work it prices of the same order as the work done. The bill itself is wall-clock seconds: whether the
    # range holds it is measured where seconds are real, by benchmarks/estimate_accuracy.py on the real model
    # (RESULTS.md §10), not asserted here. A CI run under load once held the second job's engines 30× longer
    # than the first job's and failed a bill-to-estimate ratio; token counts do not depend on the machine's load.
    assert est["est_usd_low"] < est["est_usd"] < est["est_usd_high"] < 5 * est["est_usd_low"]
    predicted = sum(t["est_output_tokens"] for t in est["tiers"].values())
    assert 0.5 < predicted / sum(r["output_tokens"] for r in second) < 2


def test_the_caps_are_one_amount_that_every_worker_of_the_job_reserves_from(store):
    """Reproducer: each process admitted engine calls against its own spend, so two drain tasks (or a
    retried one, or a second `tokenmill run`) could each spend up to a cap. Now a reservation in the
    catalog holds each admitted call's estimate until its item is stored or its claim is gone."""
    import threading
    import uuid

    from pipeline.stores.catalog import now
    from pipeline.stores.units import UnitQueue

    job = f"b-{uuid.uuid4().hex[:6]}"
    assert store.claim_planning(job, "fp", "in", "out")
    prices = {"small": 3600.0}  # USD per GPU-hour: 1 GPU-second costs $1

    def over(planned):  # a job cap of $1
        return [f"job ${sum(planned.values()):.2f} > $1"] if sum(planned.values()) > 1.0 + 1e-9 else []

    def worker():  # each worker its own connection pool, as its own process would have
        return UnitQueue(StateStore(store.engine.url.render_as_string(hide_password=False)))

    a_queue, b_queue = worker(), worker()
    a_queue.enqueue(job, "p1", 0, {"small": ["k1"]})
    a_queue.enqueue(job, "p2", 0, {"small": ["k2"]})
    a = a_queue.claim(job, "small", "a", "sa", lease_seconds=60)
    b = b_queue.claim(job, "small", "b", "sb", lease_seconds=60)
    assert a_queue.reserve(job, a, [("k1", "acme", 0.6)], prices, over) == []
    assert b_queue.reserve(job, b, [("k2", "acme", 0.6)], prices, over) == ["job $1.20 > $1"]
    assert b_queue.spent(job, prices) == {"acme": pytest.approx(0.6)}

    # k1 is stored: its measured cost ($0.10) counts instead of its reservation, and there is room for k2.
    item = {
        "id": "r1",
        "tenant": "acme",
        "partition": "p1",
        "tier": "small",
        "model": "m",
        "summary": "s",
        "prompt_tokens": 3,
        "cached_prompt_tokens": 0,
        "output_tokens": 2,
        "finish_reason": "stop",
        "gpu_seconds": 0.1,
        "baseline_gpu_seconds": 0.1,
        "created_at": now(),
    }
    store.store_items(job, {"k1": item})
    assert b_queue.spent(job, prices) == {"acme": pytest.approx(0.1)}
    assert b_queue.reserve(job, b, [("k2", "acme", 0.6)], prices, over) == []
    assert a_queue.finish(job, a)  # a's unit ends: its reservation goes with it (the item's cost stays)
    assert a_queue.spent(job, prices) == {"acme": pytest.approx(0.7)}
    # b dies: once its claim has run out, what it reserved is free again (its unit is claimable).
    b_queue.renew(job, "sb", lease_seconds=-5)
    assert a_queue.spent(job, prices) == {"acme": pytest.approx(0.1)}
    # A failed attempt stores no item, but its GPU time was paid: it counts.
    a_queue.add_charges(
        job,
        [
            {
                "charge_id": "c1",
                "partition": "p2",
                "session_id": "sb",
                "kind": "failed_attempt",
                "id": "r2",
                "tenant": "acme",
                "tier": "small",
                "gpu_seconds": 0.05,
            }
        ],
    )
    assert a_queue.spent(job, prices) == {"acme": pytest.approx(0.15)}

    # Eight workers at once, $0.28 each, against the $0.85 of room left: exactly three are admitted.
    keys = [f"c{i}" for i in range(8)]
    for i, key in enumerate(keys):
        a_queue.enqueue(job, f"q{i}", 0, {"large": [key]})
    queues = [worker() for _ in range(8)]
    units = [q.claim(job, "large", f"w{i}", f"s{i}", lease_seconds=60) for i, q in enumerate(queues)]
    admitted, barrier = [], threading.Barrier(8)

    def admit(i):
        barrier.wait()
        if not queues[i].reserve(job, units[i], [(keys[i], "acme", 0.28)], prices, over):
            admitted.append(i)

    threads = [threading.Thread(target=admit, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(admitted) == 3
    assert a_queue.spent(job, prices) == {"acme": pytest.approx(0.99)}


def test_a_second_drain_task_admits_against_what_the_first_spent(make_config, sample_corpus, tmp_path):
    """Reproducer: under the DAG each drain task is its own process; the budget guard started from zero
    spend in each, so the other tier's drain task ran its units past the cap the first had reached."""
    from pipeline.job import orchestrate

    config = make_config(
        routing=True,
        budget__max_job_usd=1e-9,
        tiers__small__default_tokens_per_gpu_second=1e12,
        tiers__large__default_tokens_per_gpu_second=1e12,
    )
    migrate(config.state.url)  # the DAG's first task's part: this test starts at `plan`
    for partition in orchestrate.planned_partitions(config, "dag"):
        orchestrate.prepared_partition(config, "dag", partition)

    def units(status):
        with sqlite3.connect(tmp_path / "state.db") as c:
            return dict(
                c.execute(
                    "select tier, count(*) from work_units where job_id='dag' and status=? group by tier", (status,)
                ).fetchall()
            )

    assert units("pending")["large"] > 0  # the compliance rule routes some records to the large tier
    assert orchestrate.drained_tier(config, "dag", "small")["units"] == 1  # its real cost crosses the cap
    assert orchestrate.drained_tier(config, "dag", "large")["units"] == 0  # a fresh process, the same cap
    assert units("done") == {"small": 1} and "large" in units("deferred")


def test_the_budget_guard_prices_a_tier_with_no_ledger_by_its_hardware_projection(make_config, tmp_path):
    """Reproducer: with no ledger yet, `tokenmill estimate` priced a real tier from the hardware
    projection but the guard that refuses a job from its configured default, so the two disagreed. The
    guard now prices the job's unpaid requests the way the estimate does, and says so when it refuses."""
    import uuid

    import pyarrow as pa

    from pipeline.job.budget import BudgetGuard
    from pipeline.plan.rates import tier_rates
    from pipeline.stores.units import UnitQueue

    migrate(f"sqlite:///{tmp_path}/guard.db")
    store = StateStore(f"sqlite:///{tmp_path}/guard.db")
    config = make_config(engine="vllm", budget__max_job_usd=1e-9)  # no engine starts: nothing is generated
    job = f"b-{uuid.uuid4().hex[:6]}"
    guard = BudgetGuard(config, store, UnitQueue(store), job)
    assert {r.method for r in tier_rates(config, config.output.uri).values()} != {"projection"}  # no ledger
    ids = [f"d{i}" for i in range(40)]
    generations = pa.table({"id": ids, "tenant": ["acme"] * 40})
    requests = pa.table({"id": ids, "tier": ["small"] * 40, "prompt_token_ids": [[1] * 300] * 40})
    with pytest.raises(JobError, match=r"refused before any GPU work: .*projection \(no ledger of this tier"):
        guard.check_start([(generations, requests)])
    assert guard.rates()["small"].method.startswith("projection")  # and the admissions that follow price alike


def test_admission_reads_running_totals_not_every_item_of_the_job(store):
    """Admission under a cap summed every item and failed attempt of the job while it held the job row's lock:
    O(items) per admission, every worker of the job queued behind it. Now the statements that store items and
    failed attempts add to a running total per tenant and tier, and admission reads that (the same amounts:
    a key stored twice counts once, lost work not at all)."""
    import uuid

    from sqlalchemy import event

    from pipeline.stores.catalog import now
    from pipeline.stores.units import UnitQueue

    job = f"t-{uuid.uuid4().hex[:6]}"
    assert store.claim_planning(job, "fp", "in", "out")
    prices, queue = {"small": 3600.0, "large": 7200.0}, UnitQueue(store)
    base = dict(partition="p", model="m", summary="s", prompt_tokens=1, cached_prompt_tokens=0, output_tokens=1)
    base |= dict(finish_reason="stop", baseline_gpu_seconds=0.0, created_at=now())
    items = {
        f"k{i}": {**base, "id": f"r{i}", "tenant": ["acme", "zen"][i % 2], "tier": ["small", "large"][i % 3 == 0]}
        | {"gpu_seconds": 0.01 * (i + 1)}
        for i in range(30)
    }
    store.store_items(job, dict(list(items.items())[:20]))
    store.store_items(job, items)  # the first twenty again: stored once, counted once
    charge = dict(partition="p", session_id="s", id="r0", tenant="acme", tier="small", gpu_seconds=0.5)
    queue.add_charges(job, [{"charge_id": "f", "kind": "failed_attempt", **charge}])
    queue.add_charges(job, [{"charge_id": "f", "kind": "failed_attempt", **charge}])  # once
    queue.add_charges(job, [{"charge_id": "l", "kind": "lost", **charge, "tenant": None}])  # no tenant's
    expected: dict[str, float] = {"acme": 0.5}
    for item in items.values():
        expected[item["tenant"]] = expected.get(item["tenant"], 0.0) + item["gpu_seconds"] * prices[item["tier"]] / 3600
    assert queue.spent(job, prices) == pytest.approx(expected)

    queue.enqueue(job, "p", 0, {"small": ["new"]})
    unit = queue.claim(job, "small", "w", "sw", lease_seconds=60)
    statements: list[str] = []
    listen = lambda conn, cursor, sql, *args: statements.append(sql.lower())  # noqa: E731
    event.listen(queue.state.engine, "before_cursor_execute", listen)
    try:
        assert queue.reserve(job, unit, [("new", "acme", 0.1)], prices, lambda planned: []) == []
    finally:
        event.remove(queue.state.engine, "before_cursor_execute", listen)
    assert statements and not [s for s in statements if "sum(items." in s or "sum(charges." in s], statements


def test_reservations_of_claims_taken_over_or_withdrawn_are_deleted_by_that_step(store):
    """A reservation counts only while its claim is live, but its row stayed for good once the claim was taken
    over or its unit withdrawn: the table grew with every dead worker. The claim that takes a unit over, and
    the withdrawal that removes it, now delete the rows they make dead; a live claim's stay."""
    import uuid

    from sqlalchemy import func, select

    from pipeline.stores.units import Reservation, UnitQueue

    job = f"r-{uuid.uuid4().hex[:6]}"
    assert store.claim_planning(job, "fp", "in", "out")
    queue, prices, room = UnitQueue(store), {"small": 3600.0}, lambda planned: []

    def rows() -> dict[str, int]:
        with store.db_session() as s:
            q = select(Reservation.unit_id, func.count()).where(Reservation.job_id == job).group_by(Reservation.unit_id)
            return dict(s.execute(q).all())

    queue.enqueue(job, "p1", 0, {"small": ["k1", "k2"]})
    queue.enqueue(job, "p2", 0, {"small": ["k3"]})
    dead = queue.claim(job, "small", "a", "sa", lease_seconds=60)
    live = queue.claim(job, "small", "b", "sb", lease_seconds=60)
    assert queue.reserve(job, dead, [("k1", "acme", 0.1), ("k2", "acme", 0.1)], prices, room) == []
    assert queue.reserve(job, live, [("k3", "acme", 0.1)], prices, room) == []
    assert rows() == {"p1/0/small": 2, "p2/0/small": 1}
    queue.renew(job, "sa", lease_seconds=-5)  # a died: its claim runs out
    taken = queue.claim(job, "small", "c", "sc", lease_seconds=60)
    assert taken.unit_id == dead.unit_id and rows() == {"p2/0/small": 1}, "the claim taken over reserves nothing"
    assert queue.reserve(job, taken, [("k1", "acme", 0.1)], prices, room) == []
    queue.renew(job, "sc", lease_seconds=-5)  # c died too; then p1 is ended where it stands
    assert queue.withdraw(job, "p1", dead_too=True) == 1 and rows() == {"p2/0/small": 1}
    assert queue.spent(job, prices) == {"acme": pytest.approx(0.1)}
