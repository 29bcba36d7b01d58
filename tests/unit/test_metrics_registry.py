"""The metrics module alone (pipeline/generate/metrics.py): bounded labels on every series, vLLM's gauges read the
way vLLM 0.32 keeps them, and what a commit counts from its tables."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
from prometheus_client import CollectorRegistry, Counter, Gauge

from pipeline.generate import metrics
from pipeline.generate.levers import GAUGES, engine_gauges, read_gauges
from pipeline.schema import LEDGER, QUARANTINE

# plus the info series' own below; `pipeline`: one per configured pipeline, on the job totals `tokenmill run`
# serves (present in this process only once a run served them, so it is allowed, not required)
BOUNDED = {"tenant", "tier", "outcome", "state", "kind", "cap", "pipeline"}


def test_every_series_is_labelled_by_bounded_dimensions_only():
    info = {"tokenmill_job_info": {"job_id"}, "tokenmill_tier_info": {"tier", "model", "gpus"}}
    declared = [m for m in vars(metrics).values() if isinstance(m, (Counter, Gauge))]
    assert len(declared) >= 15
    for m in declared:
        # prometheus_client keeps a metric's label names in `_labelnames` (its attribute, not one of ours)
        assert set(m._labelnames) <= info.get(m._name, BOUNDED), m._name
    for family in metrics.REGISTRY.collect():
        assert family.name.startswith("tokenmill_"), family.name
        for sample in family.samples:
            assert set(sample.labels) <= info.get(family.name, BOUNDED), sample
    assert metrics.metric_names() >= {"tokenmill_items_total", "tokenmill_vllm_num_requests_running"}


def vllm_shaped_logger(values: dict[str, list[float]]):
    """An LLM whose stat loggers hold a Prometheus logger shaped as vLLM 0.32's: for each gauge, one labelled child
    per engine index (vllm/v1/metrics/utils.py create_metric_per_engine), in a registry of its own."""
    registry, prom = CollectorRegistry(), SimpleNamespace()
    for name, attr in GAUGES.items():
        gauge = Gauge(name, name, labelnames=["model_name", "engine"], registry=registry)
        children = {i: gauge.labels("m", str(i)) for i in range(len(values[name]))}
        for i, v in enumerate(values[name]):
            children[i].set(v)
        setattr(prom, attr, children)
    other = SimpleNamespace()  # vLLM's logging stat logger: no Prometheus metrics
    return SimpleNamespace(llm_engine=SimpleNamespace(logger_manager=SimpleNamespace(stat_loggers=[other, prom])))


def test_vllm_gauges_are_read_from_its_own_logger_summed_over_engine_indexes():
    llm = vllm_shaped_logger(
        {"vllm:num_requests_running": [3, 2], "vllm:num_requests_waiting": [7, 0], "vllm:kv_cache_usage_perc": [0.25]}
    )
    assert engine_gauges(llm) == {
        "vllm:num_requests_running": 5.0,
        "vllm:num_requests_waiting": 7.0,
        "vllm:kv_cache_usage_perc": 0.25,
    }
    assert engine_gauges(SimpleNamespace(llm_engine=SimpleNamespace())) == {}  # stats off: nothing, no error
    assert read_gauges(object()) == {}  # an engine that keeps none (the fake one)


def test_the_gauges_read_are_where_vllm_keeps_them():
    """vLLM 0.32's PrometheusStatLogger creates each gauge under the name and attribute GAUGES gives (read from its
    source, as vllm_options does: importing vLLM costs seconds). A job on the real engine reads them in
    tests/engine/test_fake_engine_contract.py."""
    spec = importlib.util.find_spec("vllm")
    source = (Path(spec.submodule_search_locations[0]) / "v1" / "metrics" / "loggers.py").read_text()
    for name, attr in GAUGES.items():
        found = re.search(
            rf'name="{re.escape(name)}".{{0,400}}?self\.{attr} = create_metric_per_engine\(', source, re.DOTALL
        )
        assert found, f"{name} is no longer kept as PrometheusStatLogger.{attr}"


def test_the_vllm_collector_exports_a_watched_engines_gauges_by_tier():
    class Engine:
        def gauges(self):
            return {"vllm:num_requests_running": 4.0, "vllm:kv_cache_usage_perc": 0.5}

    engine, meter = Engine(), metrics.EngineMeter("tier-x")
    meter.watch(engine)
    try:
        got = {(s.name, s.labels.get("tier")): s.value for f in metrics.REGISTRY.collect() for s in f.samples}
        assert got[("tokenmill_vllm_num_requests_running", "tier-x")] == 4.0
        assert got[("tokenmill_vllm_kv_cache_usage_perc", "tier-x")] == 0.5
    finally:
        meter.unwatch()
    vllm = [s for f in metrics.REGISTRY.collect() for s in f.samples if s.name.startswith("tokenmill_vllm_")]
    assert not [s for s in vllm if s.labels.get("tier") == "tier-x"]
    # The meter's tier counters are there from 0 (a first increment is then a rise that `rate` sees).
    assert metrics.REGISTRY.get_sample_value("tokenmill_engine_seconds_total", {"tier": "tier-x", "state": "busy"}) == 0
    assert metrics.REGISTRY.get_sample_value("tokenmill_units_deferred_total", {"tier": "tier-x"}) == 0


def test_a_commit_counts_outcomes_and_money_with_missing_labels_as_none():
    def value(name, **labels):
        return metrics.REGISTRY.get_sample_value(name, labels) or 0.0

    rows = [
        {"id": "a", "tenant": "t-unit", "tier": "small", "kind": "output", "source": "generated", "cost_usd": 0.5},
        {"id": "b", "tenant": "t-unit", "tier": "small", "kind": "output", "source": "near", "cost_usd": 0.0},
        {"id": "c", "tenant": "t-unit", "tier": "small", "kind": "invalid_output", "source": "generated"},
        {"id": None, "tenant": None, "tier": "small", "kind": "lost", "cost_usd": 0.25, "gpu_seconds": 2.0},
    ]
    ledger = pa.Table.from_pylist(rows, schema=LEDGER)
    quarantine = pa.Table.from_pylist(
        [{"id": "c", "tenant": "t-unit"}, {"id": "d", "tenant": "t-unit", "reason": "malformed_json"}],
        schema=QUARANTINE,
    )
    before = {
        k: value("tokenmill_items_total", tenant="t-unit", tier=t, outcome=k)
        for k, t in (("generated", "small"), ("reused", "small"), ("quarantined", "small"), ("none", "none"))
    }
    lost = value("tokenmill_cost_usd_total", tenant="none", tier="small")
    metrics.committed(ledger, quarantine)
    assert value("tokenmill_items_total", tenant="t-unit", tier="small", outcome="generated") == before["generated"] + 1
    assert value("tokenmill_items_total", tenant="t-unit", tier="small", outcome="reused") == before["reused"] + 1
    # c paid for its invalid output on small; d never reached a tier
    assert (
        value("tokenmill_items_total", tenant="t-unit", tier="small", outcome="quarantined")
        == before["quarantined"] + 1
    )
    assert value("tokenmill_items_total", tenant="t-unit", tier="none", outcome="quarantined") >= 1
    assert value("tokenmill_cost_usd_total", tenant="none", tier="small") == lost + 0.25


def test_tenant_labels_are_bounded_whatever_the_input_holds(make_config):
    """A records file can name a new tenant on every line: past the configured ones, the default and the first
    MAX_TENANT_LABELS others, every tenant reads `other`, so a hostile file cannot mint a series per record."""
    from pipeline.generate import metrics

    metrics.begin(make_config(tenants__acme={}), "j")
    seen = set(metrics.SEEN_TENANTS)
    metrics.SEEN_TENANTS.clear()
    try:
        names = [metrics.tenant_label(f"t{i}") for i in range(metrics.MAX_TENANT_LABELS + 50)]
        assert len(set(names)) == metrics.MAX_TENANT_LABELS + 1 and names[-1] == metrics.OTHER
        assert metrics.tenant_label("acme") == "acme" and metrics.tenant_label(None) == metrics.NONE  # configured
    finally:  # the process's labels as they were, for the tests after this one
        metrics.SEEN_TENANTS.clear()
        metrics.SEEN_TENANTS.update(seen)
