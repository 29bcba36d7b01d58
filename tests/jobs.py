"""What the tests of whole jobs share: the CLI in a subprocess on the tiny config (fake engine by default),
polling a state that a test made happen, and the exactly-once check every job's output must pass."""

import os
import sqlite3
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from tests.conftest import FAKE_ENGINE, ONE_TIER, REPO, read_kind


def cli_env(tiny_models, tmp_path, engine: str = "fake", **extra) -> dict:
    """The environment of a `tokenmill` subprocess on the tiny config under `tmp_path`; `extra`: section__field=value."""
    env = {**os.environ, "TOKENMILL_HOME": str(tiny_models.parent), "TOKENMILL_STATE__URL": f"sqlite:///{tmp_path}/state.db",
           "TOKENMILL_CACHE__PATH": str(tmp_path / "cache"),
           **ONE_TIER, **(FAKE_ENGINE if engine == "fake" else {}),
           "TOKENMILL_INPUT__URI": str(tmp_path / "input"), "TOKENMILL_OUTPUT__URI": str(tmp_path / "output")}
    env.update({f"TOKENMILL_{k.upper()}": str(v) for k, v in extra.items()})
    return env


def start_cli(args, env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pipeline.cli", *args], env=env, cwd=REPO, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


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
    with sqlite3.connect(db, timeout=30) as c:
        return c.execute(sql).fetchone()[0]


def assert_exactly_once(output, job_id, corpus, state_db):
    """Every input record in exactly one output or quarantine row, and every paid generation charged once.

    `corpus`: {"ids": the good records' ids, "bad_records": how many records are bad} (write_sample_corpus's
    counts). Bad records may have no id, or repeat a good one (duplicate_id), so they are counted."""
    outputs, full_ledger, quarantine = (read_kind(output, k, job_id) for k in ("outputs", "ledger", "quarantine"))
    # Rows for GPU time no output carries (failed attempts, work lost with a dead worker) have no record.
    ledger = full_ledger.filter(pc.is_in(full_ledger["kind"], pa.array(["output", "invalid_output"])))
    expected = set(corpus["ids"])
    assert len(expected) == len(corpus["ids"])
    out_ids = outputs["id"].to_pylist()
    assert len(set(out_ids)) == len(out_ids) == ledger.num_rows and set(ledger["id"].to_pylist()) == set(out_ids)
    good_quarantined = [i for i, reason in zip(quarantine["id"].to_pylist(), quarantine["reason"].to_pylist())
                        if i in expected and reason != "duplicate_id"]  # a duplicate_id row is the bad second use
    assert not set(out_ids) & set(good_quarantined)  # outputs and quarantine are disjoint
    assert len(set(good_quarantined)) == len(good_quarantined)
    assert set(out_ids) | set(good_quarantined) == expected  # every good record ends somewhere, nothing else does
    assert quarantine.num_rows - len(good_quarantined) == corpus["bad_records"]  # every bad record: one row
    # Nothing charged twice: the ledger carries each paid-for generation exactly once.
    generated = [r for r in ledger.to_pylist() if r["source"] == "generated"]
    # One item per attempt and per chunk summary, all charged to the record that generated them.
    assert sum(r["attempts"] + r["chunks"] for r in generated) == scalar(
        state_db, f"select count(*) from items where job_id='{job_id}' and origin is null")
    assert sum(r["busy_gpu_seconds"] for r in generated) == pytest.approx(
        scalar(state_db, f"select sum(gpu_seconds) from items where job_id='{job_id}'"))
    # Every GPU-second the job's engines were held is in exactly one ledger row, and priced at its tier.
    with sqlite3.connect(state_db, timeout=30) as c:
        held = c.execute("select sum((startup_seconds + busy_seconds + idle_seconds) * gpus) from engine_sessions "
                         f"where job_id='{job_id}'").fetchone()[0] or 0.0
    assert sum(full_ledger["gpu_seconds"].to_pylist()) == pytest.approx(held, rel=1e-6, abs=1e-9)
    for r in full_ledger.to_pylist():
        assert r["gpu_seconds"] == pytest.approx(r["busy_gpu_seconds"] + r["overhead_gpu_seconds"], abs=1e-12)
        assert r["cost_usd"] == pytest.approx(r["gpu_seconds"] * r["price_per_gpu_hour"] / 3600, rel=1e-9, abs=1e-15)
    return outputs
