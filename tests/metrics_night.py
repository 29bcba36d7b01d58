"""A night's Prometheus series as tokenmill's own code emits them, for promtool (tests/unit/test_dashboard_queries.py).

`python -m tests.metrics_night` (a process of its own: the metrics registry is per process) drives
pipeline/generate/metrics.py as the steps do, minute by minute, and prints every series Prometheus would hold:

  airflow  the nightly DAG (its config and job id from pipeline.job.orchestrate.job_from_params, as the DAG's
           tasks get them): a prepare task reports at PREPARE; the `small` tier's drain task serves its endpoint
           from DRAIN[0] to DRAIN[1] (scraped each minute: generations, tokens, engine seconds, its queue, units
           deferred, vLLM's gauges) and reports as it ends; commit tasks report at COMMITS; `summary` at SUMMARY.
           A report pushes the job's state to the Pushgateway, which serves it (scraped each minute, honour_labels)
           until the next push replaces the group.
  run      `tokenmill run` of one partition: serves its endpoint from 0 to RUN_END (the expected end set at 0), its
           commit at RUN_COMMIT, and pushes at its commit and at its end.

Series are keyed by their label set as Prometheus stores them (scrape labels added, empty labels dropped), values
by minute (None: no sample). Pushes are captured where prometheus_client sends them (`push_to_gateway`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
MINUTES = 131  # samples at 0m..130m
DAG_ID = "nightly_summarization"
RUN_DATE = "2026-12-06"
PREPARE, DRAIN, COMMITS, SUMMARY = 5, (10, 50), {"a": 60, "b": 90}, 95
DEFER_AT = 30  # the drain defers DEFERRED units at a budget cap in this minute
DEFERRED = 2
BUDGET_LEFT = {("job", None): 7.5, ("tenant", "acme"): 2.25}
RUN_COMMIT, RUN_END, RUN_EXPECTED_END = (
    10,
    20,
    1200.0,
)  # minutes; the estimate's end in Unix seconds (promtool: 0 = start)
DRAIN_SCRAPE = {"job": "tokenmill-gpu-workers", "instance": "airflow-worker-gpu-small:9400"}
RUN_SCRAPE = {"job": "tokenmill-run", "instance": "host:9400"}

# Per minute of the drain, per tenant: generations the small tier stores, each with these tokens and GPU-seconds
# (at PRICE USD per GPU-hour: 0.5 USD a generation); engine seconds: a minute's start-up, then busy and idle.
PER_MINUTE = {"acme": 20, "beta": 10}
TOKENS = {"prompt_tokens": 20, "cached_prompt_tokens": 4, "output_tokens": 10}
GPU_SECONDS, PRICE = 0.5, 3600.0
STARTUP, BUSY, IDLE = 60.0, 45.0, 15.0
VLLM = {"vllm:num_requests_running": 4.0, "vllm:num_requests_waiting": 2.0, "vllm:kv_cache_usage_perc": 0.5}


def row(tenant, tier, kind, source, cost, gpu, id_=None):
    return {
        "id": id_,
        "tenant": tenant,
        "tier": tier,
        "kind": kind,
        "source": source,
        "cost_usd": cost,
        "gpu_seconds": gpu,
    }


# The ledger and quarantine rows each partition commits (the columns the metrics read).
PARTITIONS = {
    "a": {
        "ledger": [
            *[row("acme", "small", "output", "generated", 0.25, 2.0, f"a{i}") for i in range(3)],
            row("acme", "small", "output", "duplicate", 0.0, 0.0, "a3"),
            row("acme", "small", "invalid_output", "generated", 0.5, 4.0, "q1"),
            *[row("beta", "large", "output", "generated", 1.5, 6.0, f"b{i}") for i in range(2)],
            row(None, "small", "lost", None, 0.125, 1.0),
        ],
        "quarantine": [{"id": "q1", "tenant": "acme"}, {"id": "q2", "tenant": "beta"}],
    },
    "b": {
        "ledger": [
            *[row("acme", "small", "output", "generated", 0.25, 2.0, f"c{i}") for i in range(4)],
            row("beta", "small", "output", "cache", 0.0, 0.0, "d0"),
        ],
        "quarantine": [{"id": "q3", "tenant": "acme"}],
    },
}


class Prometheus:
    """What Prometheus holds: series (label sets) -> a value per minute."""

    def __init__(self):
        self.series: dict[tuple, list] = {}

    def scrape(self, minute: int, text: str, labels: dict[str, str]) -> None:
        from prometheus_client.parser import text_string_to_metric_families

        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if not s.name.startswith("tokenmill_") or s.name.endswith("_created"):
                    continue
                key = tuple(sorted((k, v) for k, v in {"__name__": s.name, **s.labels, **labels}.items() if v != ""))
                self.series.setdefault(key, [None] * MINUTES)[minute] = s.value


class Gateway:
    """The Pushgateway: each push replaces its group; every group is scraped each minute (honor_labels: the
    group's labels as pushed, `instance` empty, so dropped)."""

    def __init__(self):
        self.groups: dict[tuple, str] = {}
        self.paths: list[str] = []

    def push_to_gateway(self, gateway, job, registry, grouping_key=None, timeout=None, **_):
        from prometheus_client import generate_latest

        labels = {"job": job, **(grouping_key or {})}
        self.paths.append("/".join(f"{k}/{v}" for k, v in labels.items()))
        self.groups[tuple(sorted(labels.items()))] = generate_latest(registry).decode()

    def scrape(self, minute: int, prometheus: Prometheus) -> None:
        for labels, text in self.groups.items():
            prometheus.scrape(minute, text, dict(labels))


def tables(partition: str):
    import pyarrow as pa

    p = PARTITIONS[partition]
    return pa.Table.from_pylist(p["ledger"]), pa.Table.from_pylist(p["quarantine"])


def step(config, job_id: str, committed: list[str], claimable: dict[str, int]):
    """A step's parts as metrics.report_job reads them: the catalog's partitions (committed ones with the figures
    commit stores), the queue, the budget."""
    from pipeline.generate import metrics

    parts = [SimpleNamespace(status="succeeded", figures=metrics.partition_figures(*tables(p))) for p in committed]
    return SimpleNamespace(
        config=config,
        job_id=job_id,
        budget=SimpleNamespace(active=True, remaining=lambda: dict(BUDGET_LEFT)),
        queue=SimpleNamespace(claimable=lambda job, tier: claimable.get(tier, 0)),
        state=SimpleNamespace(partitions=lambda job: parts),
    )


class Engine:
    """An engine as the metrics read its vLLM gauges (levers.read_gauges)."""

    def gauges(self) -> dict[str, float]:
        return dict(VLLM)


def configure() -> None:
    os.environ.update(
        {
            "TOKENMILL_TIERS__SMALL__ENGINE": "fake",
            "TOKENMILL_TIERS__LARGE__ENGINE": "fake",
            "TOKENMILL_TIERS__SMALL__PRICE_PER_GPU_HOUR": str(PRICE),
            "TOKENMILL_METRICS__PUSHGATEWAY_URL": "http://pushgateway:9091",
            "TOKENMILL_TENANTS__ACME": "{}",  # configured tenants: their counters start at 0
            "TOKENMILL_TENANTS__BETA": "{}",
        }
    )


def airflow_night() -> dict:
    from prometheus_client import generate_latest

    from pipeline.generate import metrics
    from pipeline.job.orchestrate import job_from_params

    config, job_id = job_from_params({"config": str(REPO / "configs" / "tiny.yaml")}, DAG_ID, RUN_DATE)
    prometheus, gateway = Prometheus(), Gateway()
    metrics.push_to_gateway = gateway.push_to_gateway
    units = sum(PER_MINUTE.values()) * (DRAIN[1] - DRAIN[0])
    engine, meter = Engine(), None
    for minute in range(MINUTES):
        if minute == PREPARE:
            metrics.report_job(step(config, job_id, [], {"small": units}))
        if DRAIN[0] <= minute <= DRAIN[1]:
            k = minute - DRAIN[0]
            if k == 0:  # the drain task's process: its endpoint, its job, its engine (none of the prepare's gauges)
                metrics.QUEUE_UNITS.clear()
                metrics.begin(config, job_id)
                meter = metrics.EngineMeter("small")  # the tier worker's engine session
                meter.watch(engine)
            else:
                for tenant, n in PER_MINUTE.items():
                    items = [{"tenant": tenant, "gpu_seconds": GPU_SECONDS, **TOKENS}] * n
                    metrics.generated("small", items, config.tiers["small"].price_per_gpu_hour)
                meter.publish(STARTUP, BUSY * (k - 1), IDLE * (k - 1))
            metrics.queue_depth("small", units - sum(PER_MINUTE.values()) * k)
            if minute == DEFER_AT:
                for _ in range(DEFERRED):
                    metrics.deferred("small")
            if minute == DRAIN[1]:
                metrics.report_job(step(config, job_id, [], {}))
            prometheus.scrape(minute, generate_latest(metrics.REGISTRY).decode(), DRAIN_SCRAPE)
        if minute in COMMITS.values():  # a commit task: the partitions committed by now, its own the last
            metrics.report_job(step(config, job_id, [p for p, t in COMMITS.items() if t <= minute], {}))
        if minute == SUMMARY:
            metrics.report_job(step(config, job_id, list(COMMITS), {}))
        gateway.scrape(minute, prometheus)
    return {"job_id": job_id, "paths": sorted(set(gateway.paths)), "series": listed(prometheus)}


def run_night() -> dict:
    from prometheus_client import generate_latest

    from pipeline.config import load_config
    from pipeline.generate import metrics

    config = load_config(REPO / "configs" / "tiny.yaml")
    job_id = "adhoc-1"
    prometheus, gateway = Prometheus(), Gateway()
    metrics.push_to_gateway = gateway.push_to_gateway
    for minute in range(MINUTES):
        if minute == 0:
            metrics.begin(config, job_id)
            metrics.expect_end(RUN_EXPECTED_END)
        if minute == RUN_COMMIT:
            metrics.committed(*tables("a"))
            metrics.report_job(step(config, job_id, ["a"], {}))
        if minute == RUN_END:
            metrics.expect_end(None)
            metrics.report_job(step(config, job_id, ["a"], {}))
        if minute <= RUN_END:
            prometheus.scrape(minute, generate_latest(metrics.REGISTRY).decode(), RUN_SCRAPE)
        gateway.scrape(minute, prometheus)
    return {"job_id": job_id, "paths": sorted(set(gateway.paths)), "series": listed(prometheus)}


def listed(prometheus: Prometheus) -> list[dict]:
    return [{"labels": dict(k), "values": v} for k, v in sorted(prometheus.series.items())]


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    configure()
    print(json.dumps(airflow_night() if sys.argv[1] == "airflow" else run_night()))
