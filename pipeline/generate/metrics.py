"""Prometheus metrics of a run: one registry, its metrics, and how a process exposes them.

Every metric lives in REGISTRY, this module's own `CollectorRegistry`: vLLM registers (and unregisters, as
engines come and go) its metrics in prometheus_client's default one, and a scrape of ours must neither show
nor lose them by accident. Its `vllm:*` gauges are re-exported here instead, read from each watched engine at
scrape time (`VllmGauges`): nothing runs for them between scrapes.

Labels are bounded: tenant (configured tenants, the default and the first 100 others a process sees; then
`other`), tier, outcome, state, kind, cap (and model and gpus on the tier's info series). No
document id, item key, partition, session or job id is ever a label of a counter or gauge; the job a process
works on is the one `tokenmill_job_info{job_id}` series (joined on in queries), and the Pushgateway's grouping
key. A label whose value is missing (a lost-work ledger row has no tenant) reads `none`.

Who counts what. A process counts what it does itself, from its start (counters only go up, as Prometheus'
`rate` and `increase` expect):

  tier worker (generate/worker.py), as generations finish: generations, prompt / cached / output tokens and
      the USD of their busy GPU time, by tenant and tier; engine seconds by state (start-up when a session
      opens, busy and idle at each renewal and each step that finishes requests, the shut-down at its
      close), the session's utilisation, its tier's claimable units; units deferred at a budget cap. What
      the engine did, not what commits: a generation whose store is refused (another worker stored the key
      first) is counted here and not in the ledger; a partition that never commits keeps its generations
      here too.
  commit (job/commit.py), from the ledger and quarantine it writes: items by outcome (generated, reused,
      quarantined), USD, ledger GPU-seconds by kind. Exactly the committed files' figures (a partition
      committed again, its new files replacing the old, counts again).
  prepare (job/prepare.py): claimable units per tier after enqueueing; budget (job/budget.py) at each
      admission and commit: USD left under each cap.
  Job.run (one process): the expected end from the pre-flight estimate of the work it prepared.

One process (`tokenmill run`): all of the above in one registry, served from the first drain on; for a job
that commits every partition, the final counters equal the ledger's sums (tests/integration/test_metrics.py:
items and tokens exactly; USD, GPU-seconds and engine seconds × the tier's `gpus` to float rounding).

Distributed (the Airflow DAG): each drain task serves its own endpoint (scraped as a target; what it counted
in its last scrape interval is lost when its process exits, the ledger keeps it); prepare and commit tasks,
short-lived, serve nothing and push their registry to the Pushgateway (`metrics.pushgateway_url`) at the end of
each step, grouped by `job_id` and `instance` (the worker, host:pid), so that each process's group holds its own
counts and `sum()` over groups adds them up. A process that serves never pushes (its counts would be in
Prometheus twice). Groups outlive their processes: `tokenmill tables maintain` deletes those of finished jobs.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Iterable

import pyarrow as pa
import pyarrow.compute as pc
from prometheus_client import CollectorRegistry, Counter, Gauge, push_to_gateway, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from pipeline.config import MetricsConfig, TokenmillConfig, redact_url
from pipeline.generate.levers import GAUGES, read_gauges

log = logging.getLogger(__name__)

REGISTRY = CollectorRegistry()
NONE = "none"  # a label whose value is missing

ITEMS = Counter(
    "tokenmill_items",
    "Records committed, by outcome: generated (paid here), reused (duplicate, near, semantic, cache), quarantined.",
    ["tenant", "tier", "outcome"],
    registry=REGISTRY,
)
GENERATIONS = Counter(
    "tokenmill_generations",
    "Generations the tier worker's engine finished and stored (attempts, chunk summaries and reduces each count).",
    ["tenant", "tier"],
    registry=REGISTRY,
)
PROMPT_TOKENS = Counter(
    "tokenmill_prompt_tokens", "Prompt tokens of finished generations.", ["tenant", "tier"], registry=REGISTRY
)
CACHED_PROMPT_TOKENS = Counter(
    "tokenmill_cached_prompt_tokens",
    "Prompt tokens of finished generations served from vLLM's prefix cache.",
    ["tenant", "tier"],
    registry=REGISTRY,
)
OUTPUT_TOKENS = Counter(
    "tokenmill_output_tokens", "Output tokens of finished generations.", ["tenant", "tier"], registry=REGISTRY
)
ENGINE_SECONDS = Counter(
    "tokenmill_engine_seconds",
    "Wall seconds tier engines were held, by state (startup, busy, idle); times the tier's gpus: GPU-seconds.",
    ["tier", "state"],
    registry=REGISTRY,
)
UTILISATION = Gauge(
    "tokenmill_engine_utilisation_ratio",
    "Busy seconds over held seconds of the tier's current (or last) engine session in this process.",
    ["tier"],
    registry=REGISTRY,
)
QUEUE_UNITS = Gauge(
    "tokenmill_queue_units",
    "Work units of the job a tier worker could claim now, per tier.",
    ["tier"],
    registry=REGISTRY,
)
BUSY_COST = Counter(
    "tokenmill_busy_cost_usd",
    "USD of the busy GPU time of finished generations, as they finish (the budget guard's spend; no start-up or "
    "idle share, which commits add).",
    ["tenant", "tier"],
    registry=REGISTRY,
)
COST = Counter(
    "tokenmill_cost_usd",
    "USD of the committed ledger rows (busy and overhead GPU time).",
    ["tenant", "tier"],
    registry=REGISTRY,
)
GPU_SECONDS = Counter(
    "tokenmill_gpu_seconds",
    "GPU-seconds of the committed ledger rows, by kind (output, invalid_output, failed_attempt, lost, unfinished).",
    ["tier", "kind"],
    registry=REGISTRY,
)
DEFERRED = Counter(
    "tokenmill_units_deferred",
    "Work units a tier worker did not run because a budget cap would be crossed.",
    ["tier"],
    registry=REGISTRY,
)
BUDGET_LEFT = Gauge(
    "tokenmill_budget_remaining_usd",
    "USD left under a budget cap (job, or a tenant's): the cap less what the job spent and reserved.",
    ["cap", "tenant"],
    registry=REGISTRY,
)
EXPECTED_END = Gauge(
    "tokenmill_job_expected_end_timestamp_seconds",
    "When the running job should be done by the high end of its estimate (Unix time); 0: no estimate.",
    registry=REGISTRY,
)
JOB_INFO = Gauge("tokenmill_job_info", "The job this process works on (1).", ["job_id"], registry=REGISTRY)
TIER_INFO = Gauge(
    "tokenmill_tier_info",
    "A configured tier: its model and GPUs per engine (1).",
    ["tier", "model", "gpus"],
    registry=REGISTRY,
)

# vLLM's gauge name -> the name it is re-exported under (the colon is for recording rules, by convention).
VLLM_GAUGES = {name: "tokenmill_" + name.replace(":", "_") for name in GAUGES}
_engines: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # tier -> its engine running in this process


class VllmGauges(Collector):
    """vLLM's own gauges of every engine a tier worker of this process holds, labelled by tier, read at scrape
    time (levers.engine_gauges). The fake engine keeps none: its tiers export no sample."""

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return [
            GaugeMetricFamily(ours, f"vLLM's {name}, per tier.", labels=["tier"]) for name, ours in VLLM_GAUGES.items()
        ]

    def collect(self) -> Iterable[GaugeMetricFamily]:
        families = {
            name: GaugeMetricFamily(ours, f"vLLM's {name}, per tier.", labels=["tier"])
            for name, ours in VLLM_GAUGES.items()
        }
        for tier, engine in list(_engines.items()):
            for name, value in read_gauges(engine).items():
                if name in families:
                    families[name].add_metric([tier], value)
        return list(families.values())


REGISTRY.register(VllmGauges())


def metric_names() -> set[str]:
    """Every sample name this registry can expose (counters with `_total`; `_created` left out), for checks of the
    alert rules and the dashboard against it."""
    # A family is collected even with no sample yet (a labelled metric no step has touched, a fake engine's tier).
    return {f"{f.name}_total" if f.type == "counter" else f.name for f in REGISTRY.collect()}


# -- serving and pushing --------------------------------------------------------------------------------

_server_lock = threading.Lock()
_server: dict = {}  # "at": (host, port), "httpd": the server; empty: not serving


def serve(config: MetricsConfig) -> bool:
    """Serve REGISTRY on `config.host:config.port` from this process (once; again on another port). False when
    off, or when the port cannot be had: the run goes on unwatched, and says so."""
    if not config.serving:
        return False
    with _server_lock:
        at = (config.host, config.port)
        if _server.get("at") == at:
            return True
        _stop()
        try:
            httpd, _ = start_http_server(config.port, addr=config.host, registry=REGISTRY)
        except OSError as e:
            log.warning("metrics: cannot serve on %s:%d (%s); this process exports no metrics", *at, e)
            return False
        _server.update(at=at, httpd=httpd)
        log.info("metrics: serving http://%s:%d/metrics", *at)
        return True


def serving() -> bool:
    return bool(_server)


def wanted(config: MetricsConfig) -> bool:
    """Whether anything reads this process's metrics (it serves them, or pushes them): figures that cost a
    query are only gathered then."""
    return serving() or bool(config.pushgateway_url)


def stop_serving() -> None:
    """Close the endpoint (tests; a process's endpoint otherwise lasts as long as the process)."""
    with _server_lock:
        _stop()


def _stop() -> None:
    httpd = _server.pop("httpd", None)
    _server.clear()
    if httpd is not None:
        httpd.shutdown()
        httpd.server_close()


# After a failed push, none for this long: one process preparing or committing many partitions would otherwise
# wait out `push_timeout_seconds` on an unreachable gateway once per partition.
PUSH_BACKOFF_SECONDS = 60.0
_last_failure: dict[str, float] = {}  # gateway URL -> when a push to it last failed (time.monotonic)


def push(config: MetricsConfig, job_id: str, instance: str) -> bool:
    """Push REGISTRY to the Pushgateway as group {job: job_label, job_id, instance}, when one is configured and
    this process serves no endpoint. Never raises: a gateway that is down costs the task nothing but a warning
    (and its pushes for PUSH_BACKOFF_SECONDS; the next one after that sends the counters as they are then)."""
    url = config.pushgateway_url
    if not url or serving():
        return False
    if url in _last_failure and time.monotonic() - _last_failure[url] < PUSH_BACKOFF_SECONDS:
        return False
    try:
        push_to_gateway(
            config.pushgateway_url,
            job=config.job_label,
            registry=REGISTRY,
            grouping_key={"job_id": job_id, "instance": instance},
            timeout=config.push_timeout_seconds,
        )
        return True
    except Exception as e:
        _last_failure[url] = time.monotonic()
        log.warning(
            "metrics: push to %s failed (%s: %s); going on", redact_url(config.pushgateway_url), type(e).__name__, e
        )
        return False


def pushed_groups(config: MetricsConfig) -> list[dict[str, str]]:
    """The grouping labels of every group of `metrics.job_label` on the Pushgateway (its /api/v1/metrics)."""
    import json
    import urllib.request

    url = f"{config.pushgateway_url.rstrip('/')}/api/v1/metrics"
    with urllib.request.urlopen(url, timeout=config.push_timeout_seconds) as answer:
        groups = json.load(answer).get("data") or []
    return [g["labels"] for g in groups if g.get("labels", {}).get("job") == config.job_label]


def delete_group(config: MetricsConfig, labels: dict[str, str]) -> None:
    """Delete one pushed group (`labels`: its job, job_id and instance) from the Pushgateway."""
    from prometheus_client import delete_from_gateway

    key = {k: v for k, v in labels.items() if k != "job"}
    delete_from_gateway(
        config.pushgateway_url, job=config.job_label, grouping_key=key, timeout=config.push_timeout_seconds
    )


# -- what the steps record ------------------------------------------------------------------------------


# Tenants come from the input (a record's `tenant`): a hostile file could mint a series per record. A label
# names the config's tenants and its default tenant always, and the first MAX_TENANT_LABELS others a process
# sees; any further one reads `other`.
MAX_TENANT_LABELS = 100
CONFIGURED_TENANTS: set[str] = set()
SEEN_TENANTS: set[str] = set()
OTHER = "other"


def begin(config: TokenmillConfig, job_id: str) -> None:
    """This process works on `job_id` now, with `config`'s tiers and tenants: the info series, the tenant labels."""
    CONFIGURED_TENANTS.clear()
    CONFIGURED_TENANTS.update({*config.tenants, config.input.default_tenant})
    JOB_INFO.clear()
    JOB_INFO.labels(job_id).set(1)
    TIER_INFO.clear()
    for name, tier in config.tiers.items():
        TIER_INFO.labels(name, tier.generator, str(tier.gpus)).set(1)


def label(value) -> str:
    return NONE if value is None or value == "" else str(value)


def tenant_label(tenant) -> str:
    """A tenant as a label: by name if configured, the default, or among the first MAX_TENANT_LABELS others
    seen; else `other`."""
    name = label(tenant)
    if name == NONE or name in CONFIGURED_TENANTS or name in SEEN_TENANTS:
        return name
    if len(SEEN_TENANTS) < MAX_TENANT_LABELS:
        SEEN_TENANTS.add(name)
        return name
    return OTHER


def generated(tier: str, items: Iterable[dict], price_per_gpu_hour: float) -> None:
    """Generations a tier worker just stored: one increment per tenant and counter per engine step."""
    by_tenant: dict[str, list[float]] = {}
    for item in items:
        n = by_tenant.setdefault(tenant_label(item["tenant"]), [0, 0, 0, 0, 0.0])
        n[0] += 1
        n[1] += item["prompt_tokens"]
        n[2] += item["cached_prompt_tokens"]
        n[3] += item["output_tokens"]
        n[4] += item["gpu_seconds"]
    for tenant, (count, prompt, cached, output, gpu_seconds) in by_tenant.items():
        GENERATIONS.labels(tenant, tier).inc(count)
        PROMPT_TOKENS.labels(tenant, tier).inc(prompt)
        CACHED_PROMPT_TOKENS.labels(tenant, tier).inc(cached)
        OUTPUT_TOKENS.labels(tenant, tier).inc(output)
        BUSY_COST.labels(tenant, tier).inc(gpu_seconds * price_per_gpu_hour / 3600)


class EngineMeter:
    """One engine session's seconds as counters: `publish` adds what the session measured since the last call."""

    STATES = ("startup", "busy", "idle")

    def __init__(self, tier: str):
        self.tier = tier
        self.published = dict.fromkeys(self.STATES, 0.0)

    def publish(self, startup: float, busy: float, idle: float) -> None:
        for state, total in zip(self.STATES, (startup, busy, idle)):
            if total > self.published[state]:
                ENGINE_SECONDS.labels(self.tier, state).inc(total - self.published[state])
                self.published[state] = total
        held = startup + busy + idle
        UTILISATION.labels(self.tier).set(busy / held if held > 0 else 0.0)

    def watch(self, engine) -> None:
        """Re-export `engine`'s vLLM gauges under this tier while the session lasts."""
        _engines[self.tier] = engine

    def unwatch(self) -> None:
        _engines.pop(self.tier, None)


def queue_depth(tier: str, claimable: int) -> None:
    QUEUE_UNITS.labels(tier).set(claimable)


def deferred(tier: str) -> None:
    DEFERRED.labels(tier).inc()


def budget_left(left: dict[tuple[str, str], float]) -> None:
    """USD left under each cap: (cap, tenant) -> USD, cap `job` (tenant `none`) or `tenant`."""
    for (cap, tenant), usd in left.items():
        BUDGET_LEFT.labels(cap, tenant_label(tenant)).set(usd)


def expect_end(timestamp: float | None) -> None:
    """The running job's expected end (Unix time); None: no estimate (the job is over, or has none)."""
    EXPECTED_END.set(timestamp or 0.0)


def committed(ledger: pa.Table, quarantine: pa.Table) -> None:
    """A committed partition's items by outcome, USD and GPU-seconds, from the ledger and quarantine it wrote.

    A record with an output is `generated` when its row's source is, else `reused`; a quarantined record counts
    once, on the tier that generated its invalid output (a ledger row of kind invalid_output), else tier `none`."""
    outputs = ledger.filter(pc.equal(ledger["kind"], "output"))
    for row in (
        outputs.append_column("outcome", pc.if_else(pc.equal(outputs["source"], "generated"), "generated", "reused"))
        .group_by(["tenant", "tier", "outcome"])
        .aggregate([([], "count_all")])
        .to_pylist()
    ):
        ITEMS.labels(tenant_label(row["tenant"]), label(row["tier"]), row["outcome"]).inc(row["count_all"])
    invalid = ledger.filter(pc.equal(ledger["kind"], "invalid_output"))
    tier_of = dict(zip(invalid["id"].to_pylist(), invalid["tier"].to_pylist()))
    counts: dict[tuple[str, str], int] = {}
    for id_, tenant in zip(quarantine["id"].to_pylist(), quarantine["tenant"].to_pylist()):
        key = (tenant_label(tenant), label(tier_of.get(id_)))
        counts[key] = counts.get(key, 0) + 1
    for (tenant, tier), n in counts.items():
        ITEMS.labels(tenant, tier, "quarantined").inc(n)
    for row in ledger.group_by(["tenant", "tier"]).aggregate([("cost_usd", "sum")]).to_pylist():
        COST.labels(tenant_label(row["tenant"]), label(row["tier"])).inc(row["cost_usd_sum"] or 0.0)
    for row in ledger.group_by(["tier", "kind"]).aggregate([("gpu_seconds", "sum")]).to_pylist():
        GPU_SECONDS.labels(label(row["tier"]), label(row["kind"])).inc(row["gpu_seconds_sum"] or 0.0)
