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

The job's running totals (`tokenmill_job_*` gauges: committed records by outcome, USD, GPU-seconds, per tenant
and tier; `JobTotals`) are not counted by any process: each step that reports reads them from the state catalog,
where every committed partition stores its figures (`partition_figures`, in its `figures` column). So any process
can tell the whole job's totals so far, and a later report replaces an earlier one.

Distributed (the Airflow DAG, whose tasks are one-shot processes): each drain task serves its own endpoint
(scraped as a target: its counters grow while it lives; what it counted after its last scrape dies with it,
the ledger keeps it); and every prepare, drain, commit and summary task, as it ends, pushes the job's state
(`PUSHED`: the job totals, the budget left, the job and tier info; never a process's counters) to
the Pushgateway as ONE group per pipeline, {job: metrics.job_label, pipeline: <DAG id>, or `<DAG id>-batch` for
a Batch API batch's job}: each push replaces the group, so it always holds the latest job's totals, and the
series are the same from night to night (no group, no series per task, job id or process). Panels read the
gauges' values (`max_over_time`, `last_over_time` over a range), never `rate` over a once-pushed counter.
`tokenmill run` pushes the same group at its end, and serves the job totals with a `pipeline` label of their own
from its endpoint (queries take `max by (pipeline, ...)`: a copy served and a copy pushed count once); with no
Pushgateway it keeps serving after the job until one scrape has read the final values, or for
`metrics.final_scrape_grace_seconds`. `tokenmill tables maintain` deletes a group once its job finished long enough
ago, and the per-process groups (`job_id`, `instance`) older versions pushed.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import weakref
from collections.abc import Iterable
from typing import Any, Protocol

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

# The job's running totals: gauges, read from the catalog by `job_totals` (module doc). Name -> (help, labels, the
# path of its figures in a partition's `partition_figures`).
JOB_GAUGES = {
    "tokenmill_job_items": (
        "Records the job has committed so far (the partitions committed in the catalog), by outcome: generated, "
        "reused, quarantined.",
        ("tenant", "tier", "outcome"),
        "items",
    ),
    "tokenmill_job_cost_usd": (
        "USD of the ledger rows the job has committed so far (busy and overhead).",
        ("tenant", "tier"),
        "cost_usd",
    ),
    "tokenmill_job_gpu_seconds": (
        "GPU-seconds of the ledger rows the job has committed so far, by kind.",
        ("tier", "kind"),
        "gpu_seconds",
    ),
}


class JobTotals(Collector):
    """The job's running totals as gauges, from the last `job_totals`; with a `pipeline` label of their own where
    served, without where pushed (the Pushgateway group's key carries it)."""

    def __init__(self, labelled: bool):
        self.labelled = labelled

    def collect(self) -> Iterable[GaugeMetricFamily]:
        pipeline, totals = _job_totals.get("pipeline"), _job_totals.get("totals", {})
        extra = ["pipeline"] if self.labelled else []
        out = []
        for name, (help_, labels, key) in JOB_GAUGES.items():
            family = GaugeMetricFamily(name, help_, labels=extra + list(labels))
            for path, value in _leaves(totals.get(key, {}), len(labels)):
                family.add_metric(([pipeline] if self.labelled else []) + path, value)
            out.append(family)
        return out


def _leaves(tree: dict, depth: int, path: tuple = ()) -> Iterable[tuple[list[str], float]]:
    for k, v in sorted(tree.items()):
        if depth > 1:
            yield from _leaves(v, depth - 1, (*path, k))
        else:
            yield [*path, k], float(v)


_job_totals: dict = {}  # "pipeline": its name, "totals": the figures of the job's committed partitions, added up
REGISTRY.register(JobTotals(labelled=True))


class JobState(Collector):
    """What a step pushes (PUSHED): the job's totals, and the job-wide gauges this process last set (the job and
    its tiers, the budget left, the expected end); no process's counter. Not the queue: a pushed depth would stand
    still beside the live one of the tier workers that drain it (a group's budget left only falls, as the live
    one: `min` of the two is the newest)."""

    def collect(self) -> Iterable:
        yield from JobTotals(labelled=False).collect()
        for gauge in (JOB_INFO, TIER_INFO, BUDGET_LEFT, EXPECTED_END):
            yield from gauge.collect()


PUSHED = CollectorRegistry()
PUSHED.register(JobState())

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

# A job whose id a Batch API server gave (pipeline/serve/store.py `new_id("batch")`) is labelled apart from the
# scheduled runs of the same DAG or config: its own group, its own series.
BATCH_JOB_PREFIX = "batch-"
DEFAULT_PIPELINE = "run"  # `tokenmill run` with no `metrics.pipeline`


def pipeline_name(config: MetricsConfig, job_id: str) -> str:
    """The `pipeline` of a job's series and Pushgateway group: `metrics.pipeline` (the DAG sets its id), or `run`;
    `<that>-batch` for a Batch API batch's job."""
    name = config.pipeline or DEFAULT_PIPELINE
    return f"{name}-batch" if job_id.startswith(BATCH_JOB_PREFIX) else name


def grouping_key(config: MetricsConfig, job_id: str) -> dict[str, str]:
    """The Pushgateway group of a job's state, besides `job` (metrics.job_label): its pipeline alone, so that a
    night's tasks replace one group and every night reuses it (no job id, task or process in the key)."""
    return {"pipeline": pipeline_name(config, job_id)}


def push(config: MetricsConfig, job_id: str) -> bool:
    """Push the job's state (PUSHED: never this process's counters) to the Pushgateway as its pipeline's group,
    when one is configured. Never raises: a gateway that is down costs the task nothing but a warning (and its
    pushes for PUSH_BACKOFF_SECONDS; the next one after that sends the totals as they are then)."""
    url = config.pushgateway_url
    if not url:
        return False
    if url in _last_failure and time.monotonic() - _last_failure[url] < PUSH_BACKOFF_SECONDS:
        return False
    try:
        push_to_gateway(
            url,
            job=config.job_label,
            registry=PUSHED,
            grouping_key=grouping_key(config, job_id),
            timeout=config.push_timeout_seconds,
        )
        return True
    except Exception as e:
        _last_failure[url] = time.monotonic()
        log.warning("metrics: push to %s failed (%s: %s); going on", redact_url(url), type(e).__name__, e)
        return False


class JobParts(Protocol):
    """What a step's report reads: a JobContext, or a step's own part of one (job/commit.py Committing)."""

    config: TokenmillConfig
    job_id: str
    state: Any  # the catalog (stores/catalog.py StateStore): partitions(job_id)
    queue: Any  # the work units (stores/units.py UnitQueue): claimable(job_id, tier)
    budget: Any  # the caps (job/budget.py BudgetGuard): active, remaining()


def report_job(ctx: JobParts) -> bool:
    """A step's report at its end: the job's totals from the catalog, the units each tier could claim and the
    budget left, to this process's endpoint and, pushed, to its pipeline's group. Never raises: a step's end
    state is what counts, not its report."""
    config = ctx.config.metrics
    if not wanted(config):
        return False
    try:
        begin(ctx.config, ctx.job_id)
        if ctx.budget.active:
            budget_left(ctx.budget.remaining())
        for tier in ctx.config.tiers:
            queue_depth(tier, ctx.queue.claimable(ctx.job_id, tier))
        job_totals(pipeline_name(config, ctx.job_id), ctx.state.partitions(ctx.job_id))
    except Exception as e:  # the catalog gone: the step's own error says so
        log.debug("metrics: the job's state is unreadable: %s: %s", type(e).__name__, e)
        return False
    return push(config, ctx.job_id)


_scraped = threading.Condition()
_scrapes = [0]  # collections of REGISTRY by the endpoint since this process started


class _ScrapeCount(Collector):
    """Counts the endpoint's scrapes (each collects REGISTRY once), for `linger`; exports nothing."""

    def collect(self) -> Iterable[GaugeMetricFamily]:
        with _scraped:
            _scrapes[0] += 1
            _scraped.notify_all()
        return []


REGISTRY.register(_ScrapeCount())


def linger(config: MetricsConfig) -> bool:
    """At the end of `tokenmill run`: keep serving until one scrape has read the final values, or for
    `metrics.final_scrape_grace_seconds`, when the process serves and pushes to no Pushgateway (with one, the
    final values are pushed: nothing to wait for). True when a scrape came."""
    if not serving() or config.pushgateway_url or config.final_scrape_grace_seconds <= 0:
        return False
    with _scraped:
        seen = _scrapes[0]
        log.info("metrics: serving the final values until scraped (at most %gs)", config.final_scrape_grace_seconds)
        return _scraped.wait_for(lambda: _scrapes[0] > seen, timeout=config.final_scrape_grace_seconds)


def pushed_groups(config: MetricsConfig) -> list[dict]:
    """Every group of `metrics.job_label` on the Pushgateway (its /api/v1/metrics): {"labels": its grouping labels,
    "job_ids": the jobs its series name (`tokenmill_job_info`, or a `job_id` grouping label of older versions)}."""
    import urllib.request

    url = f"{config.pushgateway_url.rstrip('/')}/api/v1/metrics"
    with urllib.request.urlopen(url, timeout=config.push_timeout_seconds) as answer:
        groups = json.load(answer).get("data") or []
    out = []
    for g in groups:
        labels = g.get("labels", {})
        if labels.get("job") != config.job_label:
            continue
        info = (g.get(JOB_INFO._name) or {}).get("metrics") or []
        ids = {m.get("labels", {}).get("job_id") for m in info} | {labels.get("job_id")}
        out.append({"labels": labels, "job_ids": sorted(i for i in ids if i)})
    return out


def delete_group(config: MetricsConfig, labels: dict[str, str]) -> None:
    """Delete one pushed group (`labels`: its grouping labels, job included) from the Pushgateway."""
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
        # The tier worker's counters from 0, before their first increment: a series born at its first value hides
        # that increment from `rate` and `increase` (they need a sample before it). Per configured tenant: any
        # other tenant's series is born at its first generation.
        DEFERRED.labels(tier)
        for state in self.STATES:
            ENGINE_SECONDS.labels(tier, state)
        for tenant in sorted(CONFIGURED_TENANTS):
            for counter in (GENERATIONS, PROMPT_TOKENS, CACHED_PROMPT_TOKENS, OUTPUT_TOKENS, BUSY_COST):
                counter.labels(tenant, tier)

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


def partition_figures(ledger: pa.Table, quarantine: pa.Table) -> dict:
    """A committed partition's records by tenant, tier and outcome, USD by tenant and tier, GPU-seconds by tier and
    kind, from the ledger and quarantine it wrote, as nested JSON objects (kept in its catalog row's `figures`, for
    `job_totals`). A record with an output is `generated` when its row's source is, else `reused`; a quarantined
    record counts once, on the tier that generated its invalid output (a ledger row of kind invalid_output), else
    tier `none`. Tenants as the records name them (`none` for none): labels are bounded when exported."""
    items: dict = {}

    def add(tree: dict, keys: tuple, value) -> None:
        for k in keys[:-1]:
            tree = tree.setdefault(k, {})
        tree[keys[-1]] = tree.get(keys[-1], 0) + value

    outputs = ledger.filter(pc.equal(ledger["kind"], "output"))
    for row in (
        outputs.append_column("outcome", pc.if_else(pc.equal(outputs["source"], "generated"), "generated", "reused"))
        .group_by(["tenant", "tier", "outcome"])
        .aggregate([([], "count_all")])
        .to_pylist()
    ):
        add(items, (label(row["tenant"]), label(row["tier"]), row["outcome"]), row["count_all"])
    invalid = ledger.filter(pc.equal(ledger["kind"], "invalid_output"))
    tier_of = dict(zip(invalid["id"].to_pylist(), invalid["tier"].to_pylist()))
    for id_, tenant in zip(quarantine["id"].to_pylist(), quarantine["tenant"].to_pylist()):
        add(items, (label(tenant), label(tier_of.get(id_)), "quarantined"), 1)
    cost: dict = {}
    for row in ledger.group_by(["tenant", "tier"]).aggregate([("cost_usd", "sum")]).to_pylist():
        add(cost, (label(row["tenant"]), label(row["tier"])), row["cost_usd_sum"] or 0.0)
    gpu: dict = {}
    for row in ledger.group_by(["tier", "kind"]).aggregate([("gpu_seconds", "sum")]).to_pylist():
        add(gpu, (label(row["tier"]), label(row["kind"])), row["gpu_seconds_sum"] or 0.0)
    return {"items": items, "cost_usd": cost, "gpu_seconds": gpu}


def committed(ledger: pa.Table, quarantine: pa.Table) -> None:
    """A committed partition's items by outcome, USD and GPU-seconds (`partition_figures`), to this process's
    counters."""
    figures = partition_figures(ledger, quarantine)
    for path, n in _leaves(figures["items"], 3):
        ITEMS.labels(tenant_label(path[0]), path[1], path[2]).inc(n)
    for path, usd in _leaves(figures["cost_usd"], 2):
        COST.labels(tenant_label(path[0]), path[1]).inc(usd)
    for path, seconds in _leaves(figures["gpu_seconds"], 2):
        GPU_SECONDS.labels(*path).inc(seconds)


def job_totals(pipeline: str, partitions: Iterable) -> dict:
    """Set the job's running totals (the `tokenmill_job_*` gauges) to the figures of its committed partitions
    (catalog rows: `status`, `figures`), tenants bounded as labels; returns them."""
    totals: dict = {}

    def add(total: dict, part: dict, depth: int, bound: bool) -> None:
        for k, v in part.items():
            k = tenant_label(k) if bound else k
            if depth > 1:
                add(total.setdefault(k, {}), v, depth - 1, False)
            else:
                total[k] = total.get(k, 0) + v

    for p in partitions:
        if p.status != "succeeded" or not p.figures:
            continue
        figures = p.figures
        for _, (_, labels, key) in JOB_GAUGES.items():
            add(totals.setdefault(key, {}), figures.get(key, {}), len(labels), labels[0] == "tenant")
    _job_totals.update(pipeline=pipeline, totals=totals)
    return totals
