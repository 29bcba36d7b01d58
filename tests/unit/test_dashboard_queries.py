"""Every query of the Grafana dashboard, evaluated by promtool over a night of series that tokenmill's own code
emits (tests/metrics_night.py drives pipeline/generate/metrics.py as the DAG's tasks and `tokenmill run` do, and
captures what they serve and push): each panel shows the value the night's inputs say it must.

The Airflow night: one tier worker serves its counters while it drains (scraped each minute), and the prepare,
drain, commit and summary tasks each push the job's state once, as they end, to one Pushgateway group. So
committed records, cost and the quarantine share come from the job's running totals (gauges), and live rates from
the served counters. `tokenmill run` serves and pushes the same totals: a panel counts them once.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from tests import metrics_night as night
from tests.conftest import REPO
from tests.unit.test_infra import INFRA, dashboard

# Grafana's variables as the dashboard's "All" and a 1-minute scrape interval set them ($__rate_interval: four
# scrape intervals at least; $__range: the dashboard's time range).
VARIABLES = {"$tier": ".*", "$tenant": ".*", "$__rate_interval": "4m", "$__range": "12h"}


def promql(expr: str) -> str:
    for name, value in sorted(VARIABLES.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(name, value)
    assert "$" not in expr, expr
    return expr


@functools.cache
def series(scenario: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "tests.metrics_night", scenario], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def input_series(scenario: str) -> list[dict]:
    out = []
    for s in series(scenario)["series"]:
        labels = dict(s["labels"])
        name = labels.pop("__name__")
        selector = name + "{" + ", ".join(f"{k}={json.dumps(v)}" for k, v in sorted(labels.items())) + "}"
        out.append({"series": selector, "values": " ".join("_" if v is None else repr(v) for v in s["values"])})
    return out


# -- what the night's inputs say each panel shows -----------------------------------------------------------------


def ledger_rows(partitions):
    return [r for p in partitions for r in night.PARTITIONS[p]["ledger"]]


def quarantine_rows(partitions):
    return [r for p in partitions for r in night.PARTITIONS[p]["quarantine"]]


def outcomes(partitions) -> dict[str, float]:
    out: dict[str, float] = {}
    for r in ledger_rows(partitions):
        if r["kind"] == "output":
            outcome = "generated" if r["source"] == "generated" else "reused"
            out[outcome] = out.get(outcome, 0) + 1
    out["quarantined"] = len(quarantine_rows(partitions))
    return out


def quarantine_share(partitions) -> dict[str, float]:
    records: dict[str, list[int]] = {}
    for r in ledger_rows(partitions):
        if r["kind"] == "output":
            records.setdefault(r["tenant"], [0, 0])[1] += 1
    for r in quarantine_rows(partitions):
        n = records.setdefault(r["tenant"], [0, 0])
        n[0] += 1
        n[1] += 1
    return {t: q / n for t, (q, n) in records.items()}


def cost(partitions) -> dict[str, float]:
    out: dict[str, float] = {}
    for r in ledger_rows(partitions):
        tenant = r["tenant"] or "none"
        out[tenant] = out.get(tenant, 0.0) + r["cost_usd"]
    return out


def drain_minutes(at: int) -> int:
    """Minutes of generation the drain has counted by minute `at`."""
    return max(0, min(at, night.DRAIN[1]) - night.DRAIN[0])


def per_second(per_minute: float) -> float:
    return per_minute / 60


GENERATIONS = sum(night.PER_MINUTE.values())
COMMITTED = sorted(night.COMMITS, key=night.COMMITS.get)
AFTER_FIRST, AFTER_ALL = night.COMMITS[COMMITTED[0]] + 10, night.SUMMARY + 5
MID_DRAIN = 30


def cases():
    """(panel id, refId, scenario, eval minute, {labels: value}) for every panel target; {} = no sample."""
    k = drain_minutes(MID_DRAIN)
    held = night.STARTUP + (night.BUSY + night.IDLE) * (k - 1)
    small = lambda v: {'{tier="small"}': v}  # noqa: E731
    by = lambda label, values: {f"{{{label}={json.dumps(k)}}}": v for k, v in values.items()}  # noqa: E731
    budget = {f'{{cap="{c}", tenant="{t or "none"}"}}': v for (c, t), v in night.BUDGET_LEFT.items()}
    usd = night.GPU_SECONDS * night.PRICE / 3600
    config_tiers = tier_info()
    return [
        (1, "A", "airflow", MID_DRAIN, small(per_second(GENERATIONS))),
        (2, "A", "airflow", MID_DRAIN, small(per_second(GENERATIONS * night.TOKENS["prompt_tokens"]))),
        (2, "B", "airflow", MID_DRAIN, small(per_second(GENERATIONS * night.TOKENS["cached_prompt_tokens"]))),
        (2, "C", "airflow", MID_DRAIN, small(per_second(GENERATIONS * night.TOKENS["output_tokens"]))),
        (3, "A", "airflow", MID_DRAIN, small(night.BUSY / (night.BUSY + night.IDLE))),
        (3, "B", "airflow", MID_DRAIN, small(night.BUSY * (k - 1) / held)),
        (
            4,
            "A",
            "airflow",
            MID_DRAIN,
            {
                '{state="busy", tier="small"}': per_second(night.BUSY),
                '{state="idle", tier="small"}': per_second(night.IDLE),
                '{state="startup", tier="small"}': 0.0,
            },
        ),
        (5, "A", "airflow", AFTER_ALL + 20, by("tenant", cost(COMMITTED))),
        (5, "A", "run", night.RUN_END + 20, by("tenant", cost(["a"]))),
        (
            5,
            "B",
            "airflow",
            night.DRAIN[1],  # at the drain's last scrape (after it, Prometheus extrapolates half a scrape interval)
            {
                **by("tenant", {t: n * drain_minutes(night.DRAIN[1]) * usd for t, n in night.PER_MINUTE.items()}),
                '{tenant="default"}': 0.0,
            },
        ),
        (6, "A", "airflow", AFTER_ALL, budget),
        (7, "A", "airflow", AFTER_FIRST, by("tenant", quarantine_share(COMMITTED[:1]))),
        (7, "A", "airflow", AFTER_ALL, by("tenant", quarantine_share(COMMITTED))),
        (7, "A", "run", night.RUN_COMMIT + 2, by("tenant", quarantine_share(["a"]))),
        (8, "A", "airflow", MID_DRAIN, small(float(GENERATIONS * (night.DRAIN[1] - night.DRAIN[0] - k)))),
        (8, "B", "airflow", night.DEFER_AT + 2, small(float(night.DEFERRED))),
        (9, "A", "airflow", MID_DRAIN, small(night.VLLM["vllm:num_requests_running"])),
        (9, "B", "airflow", MID_DRAIN, small(night.VLLM["vllm:num_requests_waiting"])),
        (10, "A", "airflow", MID_DRAIN, small(night.VLLM["vllm:kv_cache_usage_perc"])),
        (11, "A", "airflow", MID_DRAIN, {}),  # the DAG sets no expected end
        (11, "A", "run", night.RUN_COMMIT, {"{}": night.RUN_EXPECTED_END * 1000}),
        (11, "A", "run", night.RUN_END + 5, {}),  # over: 0
        (12, "A", "airflow", AFTER_ALL, {f'{{job_id="{series("airflow")["job_id"]}"}}': 1.0}),
        (12, "B", "airflow", AFTER_ALL, config_tiers),
        (13, "A", "airflow", AFTER_FIRST - 15, {}),  # nothing committed yet
        (13, "A", "airflow", AFTER_FIRST, by("outcome", outcomes(COMMITTED[:1]))),
        (13, "A", "airflow", AFTER_ALL, by("outcome", outcomes(COMMITTED))),
        (13, "A", "run", night.RUN_COMMIT + 2, by("outcome", outcomes(["a"]))),  # served and pushed: counted once
        (13, "A", "run", night.RUN_END + 20, by("outcome", outcomes(["a"]))),  # pushed alone
    ]


def tier_info() -> dict[str, float]:
    out = {}
    for s in series("airflow")["series"]:
        labels = s["labels"]
        if labels["__name__"] == "tokenmill_tier_info" and "pipeline" in labels:
            key = f'{{gpus="{labels["gpus"]}", model={json.dumps(labels["model"])}, tier="{labels["tier"]}"}}'
            out[key] = 1.0
    assert len(out) == 2  # the tiny config's tiers
    return out


def targets() -> dict[tuple[int, str], str]:
    return {(p["id"], t["refId"]): t["expr"] for p in dashboard()["panels"] for t in p["targets"]}


def test_every_panel_query_has_a_case_on_the_series_the_code_emits():
    covered = {(panel, ref) for panel, ref, *_ in cases()}
    assert covered == set(targets()), sorted(set(targets()) ^ covered)
    assert series("airflow")["paths"] == ["job/tokenmill/pipeline/nightly_summarization"]  # one group, all night
    assert series("run")["paths"] == ["job/tokenmill/pipeline/run"]


def test_the_dashboards_panels_show_the_night(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("TOKENMILL_REQUIRE_PROMTOOL") == "1":
            pytest.fail("promtool is not installed (apt-get install prometheus)")
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    queries = targets()
    tests = []
    for scenario in ("airflow", "run"):
        exprs = [
            {
                "expr": promql(queries[(panel, ref)]),
                "eval_time": f"{minute}m",
                "exp_samples": [{"labels": labels, "value": value} for labels, value in expected.items()],
            }
            for panel, ref, where, minute, expected in cases()
            if where == scenario
        ]
        tests.append({"interval": "1m", "input_series": input_series(scenario), "promql_expr_test": exprs})
    (tmp_path / "panels.test.yml").write_text(yaml.safe_dump({"evaluation_interval": "1m", "tests": tests}))
    done = subprocess.run(
        [promtool, "test", "rules", "panels.test.yml"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]


def test_alert_rule_tests_use_series_shaped_as_the_code_emits_them():
    """infra/prometheus/alerts.test.yml is written by hand: each of its series names labels the code gives that
    metric (a served or a pushed series), beside the scrape's `job` and `instance`."""
    emitted: dict[str, set[frozenset]] = {}
    for scenario in ("airflow", "run"):
        for s in series(scenario)["series"]:
            labels = dict(s["labels"])
            emitted.setdefault(labels.pop("__name__"), set()).add(frozenset(labels))
    written = yaml.safe_load((INFRA / "prometheus" / "alerts.test.yml").read_text())
    for case in written["tests"]:
        for s in case["input_series"]:
            name, labels = re.fullmatch(r"(\w+)\{(.*)\}", s["series"]).groups()
            keys = frozenset(k for k, v in re.findall(r'(\w+)="([^"]*)"', labels) if v != "")
            assert keys in emitted.get(name, set()), (s["series"], sorted(map(sorted, emitted.get(name, set()))))
