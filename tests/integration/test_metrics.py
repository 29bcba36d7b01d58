"""The tier workers' Prometheus metrics (pipeline/generate/metrics.py) on a whole job, fake engine.

A job run in one process serves its metrics from its first drain; scraped mid-drain (the job held at a fault
point while a drain derives a partition's next wave), its counters are above zero and below their end; scraped
after the job, they equal what the ledger and quarantine files say, per tenant and tier. Counters are the
process's since it started, so every figure is the difference from a reading taken before the job.
A Pushgateway that is down costs a commit nothing; one that answers receives the groups of the steps.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pipeline import run_job
from pipeline.dev.samples import write_sample_corpus
from pipeline.generate import metrics
from pipeline.job import faults
from pipeline.stores.catalog import StateStore
from pipeline.stores.units import UnitQueue
from tests.conftest import read_kind
from tests.servers import free_port

HANG_GUARD = 120.0  # seconds: only a hang takes this long
LABELS = {"tenant", "tier", "outcome", "state", "kind", "cap", "model", "gpus", "job_id", "pipeline"}  # all allowed


@pytest.fixture(autouse=True)
def no_endpoint():
    """Each test starts and ends with no metrics endpoint in the process (a test that pushes must not be
    taken for one that serves)."""
    metrics.stop_serving()
    yield
    metrics.stop_serving()


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(port: int) -> Samples:
    response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
    response.raise_for_status()
    return parse(response.text)


def registry() -> Samples:
    return parse(generate_latest(metrics.REGISTRY).decode())


def by(samples: Samples, before: Samples, name: str, *keys: str) -> dict[tuple, float]:
    """`name`'s increase since `before`, summed by the labels `keys` (zero increases left out)."""
    out: dict[tuple, float] = {}
    for (n, labels), value in samples.items():
        if n == name:
            key = tuple(dict(labels)[k] for k in keys)
            out[key] = out.get(key, 0.0) + value - before.get((n, labels), 0.0)
    return {k: v for k, v in out.items() if v}


def total(samples: Samples, before: Samples, name: str, **labels: str) -> float:
    return sum(
        v - before.get((n, ls), 0.0)
        for (n, ls), v in samples.items()
        if n == name and labels.items() <= dict(ls).items()
    )


def ledger_sums(rows: list[dict], value, *keys: str) -> dict[tuple, float]:
    out: dict[tuple, float] = {}
    for r in rows:
        key = tuple(r[k] if r[k] is not None else metrics.NONE for k in keys)
        out[key] = out.get(key, 0.0) + value(r)
    return {k: v for k, v in out.items() if v}


def test_a_watched_job_counts_mid_drain_and_ends_equal_to_its_ledger(make_config, tmp_path):
    write_sample_corpus(tmp_path / "input", documents=48)
    port = free_port()
    config = make_config(
        input__records_per_partition=6,
        tiers__small__vllm__max_num_seqs=2,  # a few requests in flight: the first unit done is far from the last
        tiers__small__gpus=2,  # engine seconds x gpus = the ledger's GPU-seconds
        metrics__port=port,
    )
    before, started = registry(), time.time()
    held, release, result, seen = threading.Event(), threading.Event(), [], Counter()

    def hold_mid_drain(point, job_id, partition):
        # The second wave of a partition derived once the endpoint is up (the drain began) and generations are
        # counted: a unit is done, the job's others are not.
        if point != "wave_written" or job_id != "watched" or held.is_set():
            return
        seen[partition] += 1
        if seen[partition] >= 2 and metrics.serving() and total(registry(), before, "tokenmill_generations_total"):
            held.set()
            assert release.wait(HANG_GUARD), "the test never let the drain go on"

    def run():
        with faults.inject(hold_mid_drain):
            result.append(run_job(config, job_id="watched"))

    job = threading.Thread(target=run, daemon=True)
    job.start()
    try:
        assert held.wait(HANG_GUARD), "the job never reached its drain"
        mid = scrape(port)
    finally:
        release.set()
    job.join(HANG_GUARD)
    assert not job.is_alive() and result and result[0].manifest.as_json()["status"] == "succeeded"
    end = scrape(port)

    # Mid-drain: generations, tokens and busy seconds counted, nothing committed yet; the estimate's end ahead.
    for name in ("tokenmill_generations_total", "tokenmill_output_tokens_total", "tokenmill_prompt_tokens_total"):
        assert 0 < total(mid, before, name) < total(end, before, name), name
    assert 0 < total(mid, before, "tokenmill_engine_seconds_total", state="busy")
    assert total(mid, before, "tokenmill_items_total") == 0 < total(end, before, "tokenmill_items_total")
    assert mid[("tokenmill_job_info", (("job_id", "watched"),))] == 1
    assert mid[("tokenmill_job_expected_end_timestamp_seconds", ())] > started
    assert end[("tokenmill_job_expected_end_timestamp_seconds", ())] == 0  # the job is over
    assert end[("tokenmill_queue_units", (("tier", "small"),))] == 0  # nothing left to claim

    out = tmp_path / "output"
    ledger, quarantine = read_kind(out, "ledger", "watched").to_pylist(), read_kind(out, "quarantine", "watched")
    assert_counters_equal_the_ledger(end, before, ledger, quarantine.to_pylist(), gpus=2)
    assert_labels_are_bounded(end, config, ledger, quarantine.to_pylist())
    # The job's running totals, read from the catalog, say the same as this process's counters (and the ledger).
    for gauge, counter, keys in (
        ("tokenmill_job_items", "tokenmill_items_total", ("tenant", "tier", "outcome")),
        ("tokenmill_job_cost_usd", "tokenmill_cost_usd_total", ("tenant", "tier")),
        ("tokenmill_job_gpu_seconds", "tokenmill_gpu_seconds_total", ("tier", "kind")),
    ):
        assert by(end, {}, gauge, *keys) == pytest.approx(by(end, before, counter, *keys), rel=1e-9), gauge
        assert {dict(ls)["pipeline"] for n, ls in end if n == gauge} == {"run"}
    utilisation = result[0].manifest.as_json()["engines"]["small"]["utilisation"]
    assert end[("tokenmill_engine_utilisation_ratio", (("tier", "small"),))] == pytest.approx(utilisation, abs=1e-4)


def assert_counters_equal_the_ledger(end: Samples, before: Samples, ledger, quarantine, gpus: int) -> None:
    """What equals the ledger exactly (counts, tokens), to float summation (USD, GPU-seconds), and engine seconds
    times the tier's GPUs against the ledger's GPU-seconds (a measured float, summed in another order)."""
    outputs = [r for r in ledger if r["kind"] == "output"]
    tier_of = {r["id"]: r["tier"] for r in ledger if r["kind"] == "invalid_output"}
    items = Counter(
        (r["tenant"], r["tier"], "generated" if r["source"] == "generated" else "reused") for r in outputs
    ) + Counter((r["tenant"] or "none", tier_of.get(r["id"], "none"), "quarantined") for r in quarantine)
    assert by(end, before, "tokenmill_items_total", "tenant", "tier", "outcome") == items
    assert {o for _, _, o in items} == {"generated", "reused", "quarantined"}  # the corpus has each

    # Generations and tokens: counted by the worker, equal to the ledger's per tenant; per tier too on one tier
    # (an escalated row carries both tiers' tokens on the tier that served it).
    paid = [r for r in ledger if r["attempts"] > 0]
    assert by(end, before, "tokenmill_generations_total", "tenant", "tier") == ledger_sums(
        paid, lambda r: r["attempts"] + r["chunks"], "tenant", "tier"
    )
    for column in ("prompt_tokens", "cached_prompt_tokens", "output_tokens"):
        assert by(end, before, f"tokenmill_{column}_total", "tenant", "tier") == ledger_sums(
            ledger, lambda r, c=column: r[c], "tenant", "tier"
        ), column

    # Money and GPU-seconds: the committed rows' own figures, summed in another order.
    cost = ledger_sums(ledger, lambda r: r["cost_usd"], "tenant", "tier")
    assert by(end, before, "tokenmill_cost_usd_total", "tenant", "tier") == pytest.approx(cost, rel=1e-9)
    gpu = ledger_sums(ledger, lambda r: r["gpu_seconds"], "tier", "kind")
    assert by(end, before, "tokenmill_gpu_seconds_total", "tier", "kind") == pytest.approx(gpu, rel=1e-9)
    # The live spend, as generations finish: their busy GPU time at its price, without the overhead commits add.
    busy_usd = ledger_sums(ledger, lambda r: r["busy_gpu_seconds"] * r["price_per_gpu_hour"] / 3600, "tenant", "tier")
    assert by(end, before, "tokenmill_busy_cost_usd_total", "tenant", "tier") == pytest.approx(busy_usd, rel=1e-9)

    # Engine seconds are wall seconds of one engine; the ledger bills them times the tier's GPUs.
    seconds = by(end, before, "tokenmill_engine_seconds_total", "tier", "state")
    assert {t for t, _ in seconds} == {"small"} and seconds[("small", "busy")] > 0
    busy = sum(r["busy_gpu_seconds"] for r in ledger)
    overhead = sum(r["overhead_gpu_seconds"] for r in ledger)
    assert seconds[("small", "busy")] * gpus == pytest.approx(busy, rel=1e-6)
    held = seconds.get(("small", "startup"), 0.0) + seconds.get(("small", "idle"), 0.0)
    assert held * gpus == pytest.approx(overhead, rel=1e-6, abs=1e-9)


def assert_labels_are_bounded(end: Samples, config, ledger, quarantine) -> None:
    """No label names a record, partition, item key or engine session; the job id only on its info series."""
    state = StateStore(config.state.url)
    unbounded = (
        {r["id"] for r in ledger} | {r["id"] for r in quarantine} | {p.partition for p in state.partitions("watched")}
    )
    unbounded |= {s.session_id for s in UnitQueue(state).sessions("watched")} | {
        s.worker for s in UnitQueue(state).sessions("watched")
    }
    for name, labels in end:
        if not name.startswith("tokenmill_"):
            continue  # prometheus_client's own (python_info, gc, process): none in a dedicated registry
        for key, value in labels:
            assert key in LABELS, (name, key)
            assert value not in unbounded and not re.fullmatch(r"[0-9a-f]{16,}", value), (name, key, value)
            assert (key == "job_id") == (name == "tokenmill_job_info"), (name, key)


def small_job(tmp_path) -> None:
    (tmp_path / "input").mkdir()
    (tmp_path / "input" / "a.jsonl").write_text(
        "".join(
            f'{{"id": "d{i}", "text": "note {i} on quarterly sales and delivery", "tenant": "acme"}}\n'
            for i in range(5)
        )
    )


def test_a_pushgateway_that_refuses_connections_fails_no_commit(make_config, tmp_path, caplog, monkeypatch):
    small_job(tmp_path)
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    config = make_config(metrics__pushgateway_url=url)
    monkeypatch.setattr(metrics, "PUSH_BACKOFF_SECONDS", 0.0)  # every step tries, the commit included
    committing = []
    with (
        caplog.at_level(logging.WARNING, logger="pipeline.generate.metrics"),
        faults.inject(
            lambda point, job, p: committing.append(len(caplog.records)) if point == "before_publish" else None
        ),
    ):
        m = run_job(config, job_id="unpushed").manifest.as_json()
    assert m["status"] == "succeeded" and m["counts"]["outputs"] == 5 and committing
    failed = [i for i, r in enumerate(caplog.records) if r.getMessage().startswith(f"metrics: push to {url} failed")]
    assert failed and failed[-1] >= committing[0], "the commit pushed (and failed) after its files were committed"
    assert not metrics.serving()

    # Once a push failed, the process leaves the gateway alone for a while: no second wait, no second warning.
    monkeypatch.setattr(metrics, "PUSH_BACKOFF_SECONDS", 60.0)
    caplog.clear()
    assert not metrics.push(config.metrics, "unpushed") and not caplog.records


class Gateway(BaseHTTPRequestHandler):
    """A Pushgateway's PUT: the group's path and body, kept."""

    pushes: list[tuple[str, str]] = []

    def do_PUT(self):  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"])).decode()
        Gateway.pushes.append((unquote(self.path), body))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_steps_push_the_jobs_state_to_one_group_per_pipeline(make_config, tmp_path):
    """Every step pushes the whole job's totals, read from the catalog, to its pipeline's one group: no group per
    job, task or process (each push replaces the last), no process counter (a group holds no `rate`-able series),
    and the last push holds the job's final totals, equal to its ledger. A Batch API batch's job has its own."""
    small_job(tmp_path)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Gateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    Gateway.pushes = []
    try:
        config = make_config(
            metrics__pushgateway_url=f"http://127.0.0.1:{server.server_port}",
            metrics__job_label="tm",
            metrics__pipeline="nightly",
        )
        assert run_job(config, job_id="pushed", worker="host-a:1").manifest.as_json()["status"] == "succeeded"
        pushes, Gateway.pushes = Gateway.pushes, []
        assert run_job(config, job_id="batch-0001", worker="host-a:1").manifest.as_json()["status"] == "succeeded"
    finally:
        server.shutdown()
        server.server_close()
    assert {path for path, _ in pushes} == {"/metrics/job/tm/pipeline/nightly"}
    assert {path for path, _ in Gateway.pushes} == {"/metrics/job/tm/pipeline/nightly-batch"}
    assert len(pushes) >= 3  # prepare, the drains, the commit, the job's end
    last = parse(pushes[-1][1])
    assert last[("tokenmill_job_info", (("job_id", "pushed"),))] == 1
    assert {n for n, _ in last} <= {
        "tokenmill_job_items",
        "tokenmill_job_cost_usd",
        "tokenmill_job_gpu_seconds",
        "tokenmill_job_info",
        "tokenmill_tier_info",
        "tokenmill_budget_remaining_usd",
        "tokenmill_job_expected_end_timestamp_seconds",
    }
    assert all(key != "pipeline" for _, labels in last for key, _ in labels)  # the group's key carries it
    out = tmp_path / "output"
    ledger, quarantine = read_kind(out, "ledger", "pushed").to_pylist(), read_kind(out, "quarantine", "pushed")
    outcomes = Counter("generated" if r["source"] == "generated" else "reused" for r in ledger if r["kind"] == "output")
    outcomes["quarantined"] = quarantine.num_rows
    assert by(last, {}, "tokenmill_job_items", "outcome") == {(k,): v for k, v in outcomes.items() if v}
    assert sum(by(last, {}, "tokenmill_job_cost_usd", "tier").values()) == pytest.approx(
        sum(r["cost_usd"] for r in ledger), rel=1e-9
    )
    assert last[("tokenmill_job_expected_end_timestamp_seconds", ())] == 0  # the job is over


def test_run_serves_its_final_values_until_scraped(make_config):
    """`tokenmill run` with an endpoint and no Pushgateway: the process waits after the job for one scrape of its
    final values (or the grace period), so a job shorter than a scrape interval is still seen whole."""
    port = free_port()
    config = make_config(metrics__port=port, metrics__final_scrape_grace_seconds=HANG_GUARD).metrics
    assert metrics.serve(config)
    waited = []
    lingering = threading.Thread(target=lambda: waited.append(metrics.linger(config)), daemon=True)
    lingering.start()
    while lingering.is_alive() and not waited:
        scrape(port)  # the scrape it waits for (a scrape before it began waiting does not count: so scrape again)
        lingering.join(0.05)
    assert waited == [True]
    # With a Pushgateway the final values are pushed: nothing to wait for; nor with a grace of 0.
    assert not metrics.linger(config.model_copy(update={"pushgateway_url": "http://127.0.0.1:1"}))
    assert not metrics.linger(config.model_copy(update={"final_scrape_grace_seconds": 0}))
