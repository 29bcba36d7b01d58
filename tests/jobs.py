"""What the tests of whole jobs share: the CLI in a subprocess on the tiny config (fake engine by default),
polling a state that a test made happen, the exactly-once check every job's output must pass, and the
two-tier job run on both engines."""

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from pipeline import run_job
from pipeline.output.tables import SCHEMAS, open_table
from pipeline.stores import storage
from pipeline.stores.catalog import StateStore
from tests.conftest import FAKE_ENGINE, ONE_TIER, REPO, read_kind


def cli_env(tiny_models, tmp_path, engine: str = "fake", **extra) -> dict:
    """The environment of a `tokenmill` subprocess on the tiny config under `tmp_path`; `extra`:
    section__field=value."""
    env = {
        **os.environ,
        "TOKENMILL_HOME": str(tiny_models.parent),
        "TOKENMILL_STATE__URL": f"sqlite:///{tmp_path}/state.db",
        "TOKENMILL_CACHE__PATH": str(tmp_path / "cache"),
        **ONE_TIER,
        **(FAKE_ENGINE if engine == "fake" else {}),
        "TOKENMILL_INPUT__URI": str(tmp_path / "input"),
        "TOKENMILL_OUTPUT__URI": str(tmp_path / "output"),
    }
    env.update({f"TOKENMILL_{k.upper()}": str(v) for k, v in extra.items()})
    return env


def start_cli(args, env) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", *args],
        env=env,
        cwd=REPO,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(condition, proc, limit: float = 120.0) -> bool:
    """Poll `condition` until it holds, `proc` ends or `limit` seconds pass (a guard against a hang, never
    the thing under test: the state waited for is made to happen, and stays)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and proc.poll() is None:
        if condition():
            return True
        time.sleep(0.05)
    return bool(condition())


def scalar(db, sql):
    """One value from the state catalog: `db` a SQLite file, or a database URL (PostgreSQL)."""
    if "://" in str(db):
        from sqlalchemy import create_engine, text

        engine = create_engine(str(db))
        try:
            with engine.connect() as c:
                return c.execute(text(sql)).scalar()
        finally:
            engine.dispose()
    with sqlite3.connect(db, timeout=30) as c:
        return c.execute(sql).fetchone()[0]


def assert_exactly_once(output, job_id, corpus, state_db):
    """Every input record in exactly one output or quarantine row, and every paid generation charged once
    (`state_db`: the catalog's SQLite file or database URL).

    `corpus`: {"ids": the good records' ids, "bad_records": how many records are bad} (write_sample_corpus's
    counts). Bad records may have no id, or repeat a good one (duplicate_id), so they are counted."""
    outputs, full_ledger, quarantine = (read_kind(output, k, job_id) for k in ("outputs", "ledger", "quarantine"))
    # Rows for GPU time no output carries (failed attempts, work lost with a dead worker) have no record.
    ledger = full_ledger.filter(pc.is_in(full_ledger["kind"], pa.array(["output", "invalid_output"])))
    expected = set(corpus["ids"])
    assert len(expected) == len(corpus["ids"])
    out_ids = outputs["id"].to_pylist()
    assert len(set(out_ids)) == len(out_ids) == ledger.num_rows and set(ledger["id"].to_pylist()) == set(out_ids)
    good_quarantined = [
        i
        for i, reason in zip(quarantine["id"].to_pylist(), quarantine["reason"].to_pylist())
        if i in expected and reason != "duplicate_id"
    ]  # a duplicate_id row is the bad second use
    assert not set(out_ids) & set(good_quarantined)  # outputs and quarantine are disjoint
    assert len(set(good_quarantined)) == len(good_quarantined)
    assert set(out_ids) | set(good_quarantined) == expected  # every good record ends somewhere, nothing else does
    assert quarantine.num_rows - len(good_quarantined) == corpus["bad_records"]  # every bad record: one row
    # Nothing charged twice: the ledger carries each paid-for generation exactly once.
    # (a record that paid for an attempt here may be served another's output, the cache's: its source says so)
    generated = [r for r in ledger.to_pylist() if r["attempts"] > 0]
    # One item per attempt and per chunk summary, all charged to the record that generated them; those of a
    # record a stopped job left unanswered (a Batch API cancel) in a row of their own each, kind `unfinished`.
    unfinished = [r for r in full_ledger.to_pylist() if r["kind"] == "unfinished"]
    # The LLM judge's verdicts (checks.judge): a row each, kind `judge`, charged to the record judged.
    judged = [r for r in full_ledger.to_pylist() if r["kind"] == "judge"]
    assert sum(r["attempts"] + r["chunks"] for r in generated) + len(unfinished) + len(judged) == scalar(
        state_db, f"select count(*) from items where job_id='{job_id}' and origin is null"
    )
    assert sum(r["busy_gpu_seconds"] for r in generated + unfinished + judged) == pytest.approx(
        scalar(state_db, f"select sum(gpu_seconds) from items where job_id='{job_id}'") or 0.0
    )
    # Every GPU-second the job's engines were held is in exactly one ledger row, and priced at its tier.
    held = (
        scalar(
            state_db,
            "select sum((startup_seconds + busy_seconds + idle_seconds) * gpus) from engine_sessions "
            f"where job_id='{job_id}'",
        )
        or 0.0
    )
    by_kind: dict[str, float] = {}
    for r in full_ledger.to_pylist():
        by_kind[r["kind"]] = by_kind.get(r["kind"], 0.0) + r["gpu_seconds"]
    assert sum(by_kind.values()) == pytest.approx(held, rel=1e-6, abs=1e-9), f"ledger {by_kind} against held {held}"
    for r in full_ledger.to_pylist():
        assert r["gpu_seconds"] == pytest.approx(r["busy_gpu_seconds"] + r["overhead_gpu_seconds"], abs=1e-12)
        assert r["cost_usd"] == pytest.approx(r["gpu_seconds"] * r["price_per_gpu_hour"] / 3600, rel=1e-9, abs=1e-15)
    return outputs


def add_long_document(input_dir: Path) -> None:
    words = "revenue growth customer order shipment " * 900  # ~4,500 tokens > 2,048 context of the large tier
    lines = [{"id": "long-1", "text": words, "tenant": "acme"}, {"id": "long-2", "text": words + " ", "tenant": "acme"}]
    (input_dir / "long.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def check_a_two_tier_job(make_config, sample_corpus, tmp_path) -> None:
    """A job over both tiers (rules, escalation, map-reduce of a document over the context) accounts for every
    record and every GPU-second; run on the fake engine (tests/integration) and on vLLM (tests/engine)."""
    input_dir, counts = sample_corpus
    add_long_document(input_dir)
    config = make_config(routing=True)  # both tiers, rules and escalation, as the demo runs
    result = run_job(config, job_id="acct")
    m, out_dir = result.manifest.as_json(), tmp_path / "output"
    outputs, ledger, quarantine = (read_kind(out_dir, k, "acct") for k in ("outputs", "ledger", "quarantine"))

    # Nothing lost: every record read is an output row or a quarantine row, exactly once.
    records = counts["documents"] + counts["bad_records"] + 2
    assert m["counts"]["records"] == records == outputs.num_rows + quarantine.num_rows
    assert outputs.num_rows == m["counts"]["outputs"] and quarantine.num_rows == m["counts"]["quarantined"]
    assert len(set(outputs["id"].to_pylist())) == outputs.num_rows
    assert all(
        t.schema.equals(SCHEMAS[k]) for k, t in (("outputs", outputs), ("ledger", ledger), ("quarantine", quarantine))
    )

    # A document over the context is summarised map-reduce style, not quarantined; its copy reuses it.
    rows = {r["id"]: r for r in ledger.to_pylist()}
    assert rows["long-1"]["chunks"] >= 3 and rows["long-1"]["source"] == "generated"
    assert rows["long-1"]["route_reason"] == "rule:long-document" and rows["long-1"]["tier"] == "large"
    assert rows["long-2"]["source"] == "duplicate_in_job" and rows["long-2"]["chunks"] >= 3
    assert "too_long" not in m["counts"]["by_reason"]

    # Duplicates reuse the representative's summary and cost nothing.
    by_id = {r["id"]: r for r in outputs.to_pylist()}
    dups = [r for r in by_id.values() if r["source"] == "duplicate_in_job"]
    assert dups and m["counts"]["by_source"]["duplicate_in_job"] == len(dups)
    for d in dups:
        rep = by_id[d["source_id"]]
        assert rep["source"] == "generated" and rep["summary"] == d["summary"] and rep["tenant"] == d["tenant"]
    generated = [r for r in by_id.values() if r["source"] == "generated"]
    assert all(r["prompt_tokens"] > 0 and r["output_tokens"] > 0 for r in generated)
    assert {r["finish_reason"] for r in generated} <= {"length", "stop"}
    assert {r["template_version"] for r in by_id.values()} == {"summarize-v1"}

    # The ledger: one row per output; GPU-seconds add up to the engines' seconds × GPUs; money follows.
    assert sorted(ledger["id"].to_pylist()) == sorted(by_id)
    engine_gpu_seconds = sum(e["gpu_seconds"] for e in m["engines"].values())
    assert engine_gpu_seconds > 0
    assert pc.sum(ledger["gpu_seconds"]).as_py() == pytest.approx(engine_gpu_seconds, rel=1e-9)
    for row in ledger.to_pylist():
        if not row["escalated"]:  # escalated rows carry the blended price of their two attempts
            assert row["price_per_gpu_hour"] == config.tiers[row["tier"]].price_per_gpu_hour
        assert row["cost_usd"] == pytest.approx(
            row["gpu_seconds"] * row["price_per_gpu_hour"] / 3600, rel=1e-9, abs=1e-15
        )
        if row["source"] == "duplicate_in_job":
            assert row["cost_usd"] == 0 and row["baseline_cost_usd"] > 0
    assert m["cost"]["saved_usd"] == pytest.approx(m["cost"]["baseline_cost_usd"] - m["cost"]["cost_usd"])
    assert m["cost"]["saved_usd"] > 0

    # Files were written atomically: no temporary names left behind, one file per partition and kind, each
    # the one its table's log names, and each partition committed once (one app transaction, the claim's epoch).
    assert not [p for p in out_dir.rglob("*") if storage.temporary_target(p.name)]
    root = storage.resolve(str(out_dir))
    for kind in ("outputs", "ledger", "quarantine"):
        files = sorted(str(p) for p in (out_dir / kind / "job_id=acct").glob("partition=*/*.parquet"))
        table = open_table(root, kind)
        assert files == sorted(table.file_uris()) and len(files) == len(m["partitions"])
        assert all(table.transaction_version(f"acct/{p}") == 1 for p in m["partitions"])
    assert (out_dir / "jobs" / "acct" / "manifest.json").exists()
    assert [(j.job_id, j.status) for j in StateStore(config.state.url).jobs()] == [("acct", "succeeded")]
