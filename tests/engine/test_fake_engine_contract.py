"""The fake engine against the real one: the properties the logic tests rely on when they run on the fake.

The logic tests (tests/integration) trust that the fake engine answers like vLLM on what the pipeline reads
of an answer: prompt and output token counts, finish reasons, the streaming interface's progress, prefix-cache
accounting, the counters, start-up failures and determinism at temperature 0. Each property is checked here on
both engines, on the same tier (the tiny small model) and the same requests.
"""

from __future__ import annotations

import pytest

from pipeline.config import SamplingConfig
from pipeline.generate.engine import EnginePool
from pipeline.generate.engine_api import EngineStartError
from pipeline.generate.fake_engine import FakeEngine
from pipeline.stores.units import SESSION_COUNTERS
from tests.engines import drain

TEXTS = [
    "The quarterly report states that revenue grew while costs fell in every region.",
    "Customers asked for faster delivery of orders; the board approved a new budget.",
    "A new policy covers data retention by region before the next audit of supplier contracts.",
]


@pytest.fixture(scope="module")
def engines(make_config_module):
    """{"vllm": the real engine, "fake": a fake one} for the same tier, and that tier's tokenizer."""
    real_config, fake_config = make_config_module(engine="vllm"), make_config_module(engine="fake")
    pool = EnginePool(real_config.tiers)
    return {"vllm": pool.engine("small"), "fake": FakeEngine(fake_config.tiers["small"])}, pool.tokenizer("small")


@pytest.fixture(params=["vllm", "fake"])
def engine(request, engines):
    """Each engine in turn, with the tier's tokenizer."""
    return engines[0][request.param], engines[1]


def test_token_counts_finish_reasons_and_progress(engine):
    engine, tokenizer = engine
    prompts = [tokenizer.encode(t) for t in TEXTS]
    requests = [(f"r{i}", p, m) for i, (p, m) in enumerate(zip(prompts, [5, 12, 20]))]
    seen, done = drain(engine, requests, SamplingConfig(max_tokens=20))
    for rid, prompt, max_tokens in requests:
        c = done[rid]
        assert c.prompt_tokens == len(prompt)
        assert 0 < c.output_tokens <= max_tokens and c.output_tokens == len(c.token_ids)
        # Random-weight models never stop early; the fake (no output_tokens set) runs to max_tokens as they do.
        assert c.finish_reason == "length" and c.output_tokens == max_tokens
        assert c.text == tokenizer.decode(list(c.token_ids), skip_special_tokens=True)
        assert c.mean_logprob is not None and c.mean_logprob < 0
        assert 0 <= c.cached_prompt_tokens <= c.prompt_tokens
        progress = [p.output_tokens for p in seen if p.request_id == rid]
        assert progress == sorted(progress) and progress[-1] == c.output_tokens  # tokens only grow, then it ends
        assert sum(1 for p in seen if p.request_id == rid and p.completion is not None) == 1


def test_one_request_alone_at_temperature_zero_is_deterministic(engine):
    engine, tokenizer = engine
    prompt = tokenizer.encode(TEXTS[1])
    first = drain(engine, [("a", prompt, 16)], SamplingConfig(max_tokens=16))[1]["a"]
    again = drain(engine, [("b", prompt, 16)], SamplingConfig(max_tokens=16))[1]["b"]
    assert first.token_ids == again.token_ids and first.text == again.text


def test_a_repeated_prompt_is_served_from_the_prefix_cache_and_counted(engine):
    engine, tokenizer = engine
    prompt = tokenizer.encode(" ".join(TEXTS * 12))  # well over vLLM's CPU block of 128 tokens
    before = engine.counters()
    first = drain(engine, [("p1", prompt, 4)], SamplingConfig(max_tokens=4))[1]["p1"]
    second = drain(engine, [("p2", prompt, 4)], SamplingConfig(max_tokens=4))[1]["p2"]
    after = engine.counters()
    assert set(before) == set(after) == set(SESSION_COUNTERS)
    assert second.cached_prompt_tokens > 0 and second.cached_prompt_tokens <= len(prompt)
    assert second.cached_prompt_tokens >= first.cached_prompt_tokens
    assert after["prefix_queries"] - before["prefix_queries"] >= 2 * len(prompt) - 2
    assert after["prefix_hits"] - before["prefix_hits"] >= second.cached_prompt_tokens
    assert after["spec_drafted"] is None and after["spec_accepted"] is None  # no speculation configured


def test_generate_returns_one_completion_per_prompt_in_order(engine):
    engine, tokenizer = engine
    prompts = [tokenizer.encode(t) for t in TEXTS]
    out = engine.generate(prompts, [3, 6, 9], SamplingConfig(max_tokens=9))
    assert [c.prompt_tokens for c in out] == [len(p) for p in prompts]
    assert [c.output_tokens for c in out] == [3, 6, 9]


@pytest.mark.parametrize("kind", ["vllm", "fake"])
def test_a_model_folder_that_cannot_load_is_an_engine_start_error(make_config_module, tmp_path, kind):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    config = make_config_module(engine=kind, tiers__small__model=str(tmp_path / "broken"))
    with pytest.raises(EngineStartError, match="tier small") as e:
        EnginePool(config.tiers).engine("small")
    assert str(tmp_path / "broken") in str(e.value)


def test_both_engines_count_the_same_prompt_cached_tokens_and_counters(engines):
    """Side by side on cold caches: prompts that share a prefix of whole blocks, one exactly a block multiple
    long (its last block is always computed), one a strict prefix of another. The fake's counts must be
    vLLM's, request by request, and so must the counters' deltas."""
    by_kind, tokenizer = engines
    shared = tokenizer.encode(" ".join(TEXTS * 12))[:300]
    prompts = [shared, shared[:256], shared + tokenizer.encode(" Then the board met."), shared[:130]]
    seen = {}
    for kind, engine in by_kind.items():
        engine.reset_prefix_cache()
        before = engine.counters()
        cached = [
            drain(engine, [(f"{kind}-{i}", p, 2)], SamplingConfig(max_tokens=2))[1][f"{kind}-{i}"].cached_prompt_tokens
            for i, p in enumerate(prompts)
        ]
        after = engine.counters()
        seen[kind] = cached, {k: after[k] - before[k] for k in ("prefix_queries", "prefix_hits")}
    assert seen["fake"] == seen["vllm"], seen
    # From cold: nothing; a 256-token prefix hits one block (its second holds the last token); a longer
    # prompt over the same 300 hits both; 130 tokens hit one.
    assert seen["vllm"][0] == [0, 128, 256, 128]


def test_the_real_engine_reports_the_vllm_gauges_the_metrics_endpoint_re_exports(engines):
    """generate/metrics.py re-exports vLLM's scheduler and KV-cache gauges per tier, read from the engine's own
    Prometheus logger (levers.engine_gauges); the fake engine keeps none, so only here is that read real."""
    from pipeline.generate.levers import GAUGES, read_gauges

    by_kind, tokenizer = engines
    drain(by_kind["vllm"], [("gauges", tokenizer.encode(TEXTS[0]), 4)], SamplingConfig(max_tokens=4))
    gauges = read_gauges(by_kind["vllm"])
    assert set(gauges) == set(GAUGES), gauges
    assert gauges["vllm:num_requests_waiting"] == 0 and gauges["vllm:num_requests_running"] >= 0
    assert 0 <= gauges["vllm:kv_cache_usage_perc"] <= 1
    assert read_gauges(by_kind["fake"]) == {}
