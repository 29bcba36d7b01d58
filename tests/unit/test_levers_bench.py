"""benchmarks/levers.py without an engine: its configs load, its figures and table add up, its lock is a lock."""

from __future__ import annotations

import fcntl

import pytest

from benchmarks import levers


@pytest.mark.parametrize("fp8", [True, False])
def test_every_lever_config_loads(tmp_path, monkeypatch, fp8):
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path / "home"))
    plan = levers.runs(fp8_ok=fp8, blocks=0)
    names = [r["name"] for r in plan]
    assert names[0] == "float32 (baseline)" and len(set(names)) == len(names)
    for i, run in enumerate(plan):
        (tmp_path / f"run{i}").mkdir()
        config = levers.job_config(run, tmp_path / f"run{i}", tmp_path / "in")
        assert set(config.tiers) == set(run["tiers"])
        assert config.dedup.exact is bool(run.get("reuse")) and not config.dedup.semantic
        assert config.cache.enabled is False
        assert config.requests.prefix_ordering is run.get("ordering", True)
        for name, tier in config.tiers.items():
            assert tier.model.endswith(run["tiers"][name]["model"].rsplit("/", 1)[-1])
            assert tier.model.startswith(str(tmp_path / "home"))
    fp8_row = next(r for r in plan if r["name"] == "FP8 KV cache")
    assert (fp8_row.get("skip") is None) is fp8
    on = levers.job_config(plan[-1], tmp_path / "run0", tmp_path / "in")
    assert on.route.default_tier == "small" and on.route.escalation.on_unfaithful
    assert on.tiers["large"].vllm.engine_kwargs()["speculative_config"]["method"] == "ngram"
    assert on.tiers["small"].price_per_gpu_hour < on.tiers["large"].price_per_gpu_hour


def test_cut_ends_at_a_sentence():
    text = "One sentence here. " * 20
    assert levers.cut("short", 100) == "short"
    out = levers.cut(text, 100)
    assert len(out) <= 100 and out.endswith(".")


def test_pressure_blocks_hold_two_requests_and_one_context():
    base = {
        "outputs": {"a": {"prompt_tokens": 700, "output_tokens": 96}, "b": {"prompt_tokens": 900, "output_tokens": 96}}
    }
    assert levers.pressure_blocks(base) == 2048 // levers.BLOCK + 2  # 2 × 896 tokens < one 2,048 context
    big = {"outputs": {"a": {"prompt_tokens": 1900, "output_tokens": 96}}}
    assert levers.pressure_blocks(big) == -(-2 * 1996 // levers.BLOCK) + 2


def test_figures_and_table():
    docs = {i: {"text": "Alpha beta gamma."} for i in ("a", "b")}
    ledger = [{"cost_usd": 0.002, "busy_gpu_seconds": 1.8, "price_per_gpu_hour": 2.0}] * 2
    engines = {"large": {"items": 2, "output_tokens": 40, "busy_seconds": 2.0, "held_seconds": 5.0}}
    manifest = {
        "counts": {"by_tier": {"large": 2}, "by_source": {"generated": 2}},
        "tokens": {"prompt_tokens": 100, "cached_prompt_tokens": 25, "output_tokens": 40},
        "prefix_cache": {"hit_ratio": 0.25},
        "routing": {},
    }
    base = {
        "manifest": manifest,
        "ledger": ledger,
        "engines": engines,
        "wall_seconds": 1.0,
        "outputs": {"a": {"summary": "Alpha beta."}, "b": {"summary": "Gamma."}},
    }
    other = {**base, "outputs": {"a": {"summary": "Alpha beta."}, "b": {"summary": "Delta 42."}}}
    row = levers.figures({"lever": "x"}, other, base, docs)
    assert row["output_tokens_per_second"] == 20.0
    assert row["ledger_usd_per_1k_docs"] == 2.0
    assert row["busy_usd_per_1k_docs"] == pytest.approx(1000 * 2 * 1.8 * 2.0 / 3600 / 2, abs=1e-5)
    assert row["identical_share"] == 0.5 and row["unfaithful_rate"] == 0.5  # "42" is not in the document
    assert 0 < row["rouge_l_vs_float32"] < 1
    text = levers.table(
        {
            "base": levers.figures({"lever": "b"}, base, None, docs),
            "x": row,
            "fp8": {"lever": "kv", "skipped": "not supported here"},
        }
    )
    lines = text.splitlines()
    assert len(lines) == 5 and all(line.count("|") == lines[0].count("|") for line in lines)
    assert "not supported here" in lines[-1]


def test_engine_lock_is_exclusive(tmp_path):
    path = tmp_path / "engine.lock"
    lock = levers.EngineLock(str(path))
    lock.acquire()
    lock.acquire()  # held already: no second lock, no deadlock
    with open(path, "a") as other:
        with pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.release()
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(other, fcntl.LOCK_UN)
