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

TEXTS = ["The quarterly report states that revenue grew while costs fell in every region.",
         "Customers asked for faster delivery of orders; the board approved a new budget.",
         "A new policy covers data retention by region before the next audit of supplier contracts."]


@pytest.fixture(scope="module")
def engines(make_config_module):
    """(the real vLLM engine, a fake one) for the same tier, and that tier's tokenizer."""
    real_config, fake_config = make_config_module(engine="vllm"), make_config_module(engine="fake")
    pool = EnginePool(real_config.tiers)
    return pool.engine("small"), FakeEngine(fake_config.tiers["small"]), pool.tokenizer("small")


def drain(engine, requests, sampling):
    """Run (id, prompt, max_tokens) through add/step; every Progressed, in order, and the completions."""
    for rid, prompt, max_tokens in requests:
        engine.add(rid, prompt, max_tokens, sampling)
    seen, done = [], {}
    while len(done) < len(requests):
        for p in engine.step():
            seen.append(p)
            if p.completion is not None:
                done[p.request_id] = p.completion
    return seen, done


@pytest.mark.parametrize("which", ["vllm", "fake"])
def test_token_counts_finish_reasons_and_progress(engines, which):
    engine = engines[0] if which == "vllm" else engines[1]
    tokenizer = engines[2]
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


@pytest.mark.parametrize("which", ["vllm", "fake"])
def test_one_request_alone_at_temperature_zero_is_deterministic(engines, which):
    engine = engines[0] if which == "vllm" else engines[1]
    prompt = engines[2].encode(TEXTS[1])
    first = drain(engine, [("a", prompt, 16)], SamplingConfig(max_tokens=16))[1]["a"]
    again = drain(engine, [("b", prompt, 16)], SamplingConfig(max_tokens=16))[1]["b"]
    assert first.token_ids == again.token_ids and first.text == again.text


@pytest.mark.parametrize("which", ["vllm", "fake"])
def test_a_repeated_prompt_is_served_from_the_prefix_cache_and_counted(engines, which):
    engine = engines[0] if which == "vllm" else engines[1]
    prompt = engines[2].encode(" ".join(TEXTS * 12))  # well over vLLM's CPU block of 128 tokens
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


@pytest.mark.parametrize("which", ["vllm", "fake"])
def test_generate_returns_one_completion_per_prompt_in_order(engines, which):
    engine = engines[0] if which == "vllm" else engines[1]
    prompts = [engines[2].encode(t) for t in TEXTS]
    out = engine.generate(prompts, [3, 6, 9], SamplingConfig(max_tokens=9))
    assert [c.prompt_tokens for c in out] == [len(p) for p in prompts]
    assert [c.output_tokens for c in out] == [3, 6, 9]


@pytest.mark.parametrize("engine", ["vllm", "fake"])
def test_a_model_folder_that_cannot_load_is_an_engine_start_error(make_config_module, tmp_path, engine):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    config = make_config_module(engine=engine, tiers__small__model=str(tmp_path / "broken"))
    with pytest.raises(EngineStartError, match="tier small") as e:
        EnginePool(config.tiers).engine("small")
    assert str(tmp_path / "broken") in str(e.value)
