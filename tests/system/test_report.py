"""The HTML cost report, rendered in headless Chromium: every chart must draw; its quality section
from the ledger's faithfulness columns (old ledgers without them too) and a `tokenmill eval` result."""

import json
import os
import re
import shutil
import subprocess
from datetime import datetime, timezone

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from pipeline import run_job
from pipeline.cli import app
from pipeline.output.report import build_report, load_eval
from pipeline.output.tables import new_commit_id, publish, stage
from pipeline.schema import LEDGER, OUTPUTS, QUARANTINE
from pipeline.stores import storage
from tests.conftest import REPO

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture
def chromium():
    if CHROMIUM is None:
        if os.environ.get("TOKENMILL_REQUIRE_CHROMIUM") == "1":
            pytest.fail("chromium is required here (apt-get install chromium)")
        pytest.skip("no chromium on this machine (apt-get install chromium)")
    return CHROMIUM


def test_report_renders_offline_with_every_chart_drawn(make_config, sample_corpus, tmp_path, chromium):
    config = make_config()
    run_job(config, job_id="report")  # no engine left running by an earlier test (conftest): it pays for its start
    page = build_report(config.output.uri, "report")
    assert "http://" not in page and "https://" not in page  # nothing fetched from a network
    assert 'id="checks-by-tier"' in page and "No eval result" in page
    assert 'id="engine-utilisation"' in page and "+ engine start-up and idle" in page  # the engine's start was paid
    assert all(float(v) < 0 for v in re.findall(r'>− [^<]*</text><rect [^>]*data-value="([\d.-]+)"', page))
    html_file = tmp_path / "report.html"
    html_file.write_text(page)

    base = [chromium, *FLAGS, f"--user-data-dir={tmp_path / 'chromium'}"]
    dom = subprocess.run([*base, "--dump-dom", html_file.as_uri()], capture_output=True, text=True, timeout=120).stdout
    drawn = dict(re.findall(r'<svg class="chart" id="([\w-]+)"[^>]*data-drawn="(\d+)"', dom))
    assert set(drawn) == {
        "cost-by-tenant",
        "cost-by-tier",
        "savings",
        "tokens-per-second",
        "reuse",
        "slowest-partitions",
    }
    assert int(drawn["cost-by-tenant"]) == 4  # acme, globex, initech and the default tenant of .txt/.md
    assert int(drawn["savings"]) >= 3 and all(int(n) > 0 for n in drawn.values())

    artifacts = REPO / "build" / "test-artifacts"
    artifacts.mkdir(parents=True, exist_ok=True)
    shot = artifacts / "report.png"
    subprocess.run(
        [*base, "--window-size=900,1400", f"--screenshot={shot}", html_file.as_uri()], capture_output=True, timeout=120
    )
    assert shot.exists() and shot.stat().st_size > 10_000


def test_report_for_unknown_job_is_a_clear_error(tmp_path):
    from pipeline.stores.storage import StorageError

    with pytest.raises(StorageError, match="no manifest for job nope"):
        build_report(str(tmp_path), "nope")


# -- the quality section, from files written here (no engine) ------------------------------------

EVAL = {
    "holdout": {"path": "data/holdout.jsonl", "documents": 300, "variants": 250},
    "baseline_tier": "large",
    "models": {"small": "m-w4a16", "large": "m-f32"},
    "tiers": {
        "small": {
            "rouge_l_vs_baseline": 0.4123,
            "unfaithful_rate": 0.12,
            "unfaithful_ci95": [0.09, 0.16],
            "cost_per_1k_usd": 0.01234,
        },
        "large": {
            "rouge_l_vs_baseline": 1.0,
            "unfaithful_rate": 0.05,
            "unfaithful_ci95": [0.03, 0.08],
            "cost_per_1k_usd": 0.05678,
        },
    },
    "routing": {
        "target_quality": 0.95,
        "test_documents": 150,
        "all_large": {"cost_per_1k_usd": 0.05678},
        "chosen": {
            "router_threshold": 0.35,
            "min_mean_logprob": -1.25,
            "on_truncation": True,
            "on_unfaithful": True,
            "quality_kept": 0.9512,
            "small_share": 0.42,
            "escalated_share": 0.18,
            "cost_per_1k_usd": 0.04321,
        },
    },
    "reuse": {"total": {"reused": 40, "false_hits": 1, "false_hit_rate": 0.025, "ci95": [0.0044, 0.1288]}},
}


def ledger_rows(job_id: str) -> list[dict]:
    """Six served outputs: on small, two unfaithful (one a loop too); on large, two escalated (unfaithful,
    truncated), one flagged; and a charge row (lost work), which is no document."""
    rows = []
    for i, (tier, unfaithful, reason) in enumerate(
        [
            ("small", True, None),
            ("small", True, None),
            ("small", False, None),
            ("large", False, "unfaithful"),
            ("large", True, "truncated"),
            ("large", False, None),
        ]
    ):
        checks = {"degenerate": i == 0, "copied": False, "off_topic": False}
        rows.append(
            {
                "job_id": job_id,
                "partition": "p0",
                "id": f"d{i}",
                "tenant": "acme",
                "tier": tier,
                "model": f"m-{tier}",
                "source": "generated",
                "escalated": reason is not None,
                "escalation_reason": reason,
                "kind": "output",
                **checks,
                "acceptable": not (unfaithful or any(checks.values())),
                "unfaithful": unfaithful,
                "prompt_tokens": 100,
                "cached_prompt_tokens": 0,
                "output_tokens": 20,
                "gpu_seconds": 1.0,
                "price_per_gpu_hour": 3.6,
                "cost_usd": 0.001,
                "baseline_cost_usd": 0.002,
                "created_at": datetime(2026, 11, 30, tzinfo=timezone.utc),
            }
        )
    rows.append(
        {
            **rows[0],
            "id": None,
            "kind": "lost",
            "escalated": False,
            "unfaithful": None,
            "degenerate": None,
            "copied": None,
            "off_topic": None,
            "acceptable": None,
            "gpu_seconds": 0.5,
            "cost_usd": 0.0005,
        }
    )
    return rows


def write_manifest(root: storage.Location, job_id: str, models: dict[str, str]) -> None:
    manifest = {
        "job_id": job_id,
        "status": "succeeded",
        "largest_tier": "large",
        "cost": {"cost_usd": 0.006, "baseline_cost_usd": 0.012},
        "engines": {t: {"model": m, "output_tokens_per_second": 10.0} for t, m in models.items()},
        "counts": {"records": 6, "outputs": 6, "quarantined": 0, "by_source": {"generated": 6}, "by_reason": {}},
        "partitions": {"p0": {"file": "a.jsonl", "status": "succeeded", "seconds": 1.0}},
        "reuse": {"verification": {"checked": 0}},
    }
    storage.write_bytes_atomic(root, root.join("jobs", job_id, "manifest.json"), json.dumps(manifest).encode())


def empty(kind_schema: pa.Schema) -> pa.Table:
    return pa.schema([("partition", pa.string()), *kind_schema]).empty_table()


def write_job(out, job_id: str, old_ledger: bool = False) -> str:
    """A committed one-partition job; `old_ledger`: its ledger file written before the faithfulness columns."""
    root = storage.resolve(str(out))
    commit = new_commit_id(1)
    ledger = pa.Table.from_pylist(ledger_rows(job_id), schema=LEDGER)
    files = stage(
        root,
        job_id,
        "p0",
        {"ledger": ledger, "outputs": empty(OUTPUTS), "quarantine": empty(QUARANTINE)},
        "zstd",
        commit,
    )
    if old_ledger:  # the file as a version before those columns wrote it
        path = root.join("ledger", files["ledger"][0]["path"])
        pq.write_table(
            ledger.drop_columns(
                [
                    "job_id",
                    "partition",
                    "escalation_reason",
                    "unfaithful",
                    "degenerate",
                    "copied",
                    "off_topic",
                    "acceptable",
                ]
            ),
            path,
        )
        files["ledger"][0]["size"] = os.path.getsize(path)
    publish(root, job_id, "p0", 1, files)
    write_manifest(root, job_id, {"small": "m-w4a16", "large": "m-f32"})
    return str(out)


def cells(page: str, table_id: str) -> list[list[str]]:
    table = re.search(rf'<table class="quality" id="{table_id}">(.*?)</table>', page, re.S)
    assert table, f"no table {table_id}"
    return [re.findall(r"<td>(.*?)</td>", row) for row in re.findall(r"<tr>(.*?)</tr>", table[1]) if "<td>" in row]


def test_quality_section_counts_unfaithful_and_escalations_and_shows_the_eval(tmp_path):
    eval_file = tmp_path / "eval.json"
    eval_file.write_text(json.dumps(EVAL))
    page = build_report(write_job(tmp_path / "out", "q"), "q", eval_result=load_eval(eval_file))
    assert cells(page, "checks-by-tier") == [
        ["large", "3", "0 (0.0%)", "0 (0.0%)", "0 (0.0%)", "1 (33.3%)", "2 (66.7%)", "$0.001000", "$0.001500", "2"],
        ["small", "3", "1 (33.3%)", "0 (0.0%)", "0 (0.0%)", "2 (66.7%)", "1 (33.3%)", "$0.001167", "$0.003500", "0"],
    ]
    # (the small tier's lost work, $0.0005, is in its cost per document as `ledger summary` counts it)
    assert cells(page, "escalations") == [["truncated", "1"], ["unfaithful", "1"]]
    assert cells(page, "eval-tiers") == [
        ["small", "m-w4a16", "0.412", "12.0% (9.0% - 16.0%)", "$0.01234"],
        ["large", "m-f32", "1.000", "5.0% (3.0% - 8.0%)", "$0.05678"],
    ]
    assert (
        "quality kept 95.1%, 42.0% kept on the small tier, 18.0% escalated, $0.04321 per 1k documents "
        "(all-large $0.05678); router below 0.35 to the large tier, escalate below mean log-probability -1.250, "
        "truncation on, unfaithful on."
    ) in page
    assert "1 false hits in 40 reuses (2.5%, 95% CI 0.4%-12.9%)" in page
    assert "no near or semantic reuse was shadow-verified" in page
    assert "other models than the eval measured" not in page


def test_quality_section_renders_an_old_ledger_and_a_stale_or_failed_eval(tmp_path):
    out = write_job(tmp_path / "out", "old", old_ledger=True)
    stale = {**EVAL, "models": {"small": "m-w8a8", "large": "m-f32"}, "routing": {**EVAL["routing"], "chosen": None}}
    eval_file = tmp_path / "eval.json"
    eval_file.write_text(json.dumps(stale))
    page = build_report(out, "old", eval_result=load_eval(eval_file))
    old = ["not recorded"] * 5
    assert cells(page, "checks-by-tier") == [
        ["large", "3", *old, "$0.001000", "-", "2"],
        ["small", "3", *old, "$0.001167", "-", "0"],
    ]
    assert cells(page, "escalations") == [["not recorded", "2"]]
    assert "none keeps 95.0% of all-large quality" in page

    all_large = {**EVAL, "routing": {**EVAL["routing"], "chosen": {**EVAL["routing"]["all_large"], "all_large": True}}}
    eval_file.write_text(json.dumps(all_large))
    assert "everything on large, $0.05678 per 1k documents" in build_report(
        out, "old", eval_result=load_eval(eval_file)
    )
    assert "other models than the eval measured on small" in page


def test_report_command_reads_the_latest_eval_or_refuses_a_bad_one(tmp_path, monkeypatch):
    out = write_job(tmp_path / "out", "cli")
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path / "home"))
    runner, html_file = CliRunner(), tmp_path / "r.html"
    args = ["report", "--output", out, "--job-id", "cli", "--out", str(html_file)]
    assert runner.invoke(app, args).exit_code == 0
    assert "No eval result" in html_file.read_text()  # no eval.json under TOKENMILL_HOME yet

    (tmp_path / "home" / "eval").mkdir(parents=True)
    (tmp_path / "home" / "eval" / "eval.json").write_text(json.dumps(EVAL))
    assert runner.invoke(app, args).exit_code == 0
    assert 'id="eval-tiers"' in html_file.read_text()

    (tmp_path / "bad.json").write_text("{not json")
    bad = runner.invoke(app, [*args, "--eval", str(tmp_path / "bad.json")])
    assert bad.exit_code != 0 and "eval result" in bad.output and "bad.json" in bad.output
    missing = runner.invoke(app, [*args, "--eval", str(tmp_path / "none.json")])
    assert missing.exit_code != 0 and "none.json" in missing.output


def _strings_everywhere(value, payload: str):
    """Every string of an eval.json, and every number, replaced by `payload`: what a crafted file can hold."""
    if isinstance(value, dict):
        return {k: _strings_everywhere(v, payload) for k, v in value.items()}
    if isinstance(value, list):
        return [_strings_everywhere(v, payload) for v in value]
    return payload if isinstance(value, (str, int, float)) and not isinstance(value, bool) else value


def test_a_crafted_eval_json_cannot_run_script_or_crash_the_report(tmp_path):
    """Reproducers (red team): `holdout.documents` from eval.json went into an <h3> unescaped, so a crafted
    eval.json ran script when the report was opened; values formatted with `:.2f` crashed on a string."""
    out = write_job(tmp_path / "out", "x")
    payload = "<script>alert(1)</script><img src=x onerror=alert(2)>"
    crafted = {
        **EVAL,
        "holdout": {"documents": payload},
        "models": {"small": payload, "large": payload},
        "baseline_tier": payload,
    }
    for result in (
        crafted,
        {**_strings_everywhere(EVAL, payload), "tiers": _strings_everywhere(EVAL["tiers"], payload)},
        {**EVAL, "tiers": {payload: {"rouge_l_vs_baseline": "0.4", "cost_per_1k_usd": [1]}}},
    ):
        eval_file = tmp_path / "eval.json"
        eval_file.write_text(json.dumps(result))
        page = build_report(out, "x", eval_result=load_eval(eval_file))
        assert "<script>alert" not in page and "<img" not in page
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert page.count("<script>") == 1  # the report's own bar check, nothing else
