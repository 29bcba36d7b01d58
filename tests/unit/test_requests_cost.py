import numpy as np
import pyarrow as pa
import pytest

from pipeline.config import CostConfig, PromptConfig, RequestsConfig, SamplingConfig, TierConfig
from pipeline.generate.engine import EnginePool
from pipeline.generate.pricing import baseline_gpu_seconds
from pipeline.generate.requests import build_requests, render_messages, render_prompts


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    return EnginePool({"small": TierConfig(model=str(tiny_models / "tiny-small"), price_per_gpu_hour=1)}).tokenizer(
        "small"
    )


def reps(texts):
    n = len(texts)
    return pa.table(
        {
            "id": [f"d{i}" for i in range(n)],
            "text": texts,
            "tier": ["small"] * n,
            "duplicate_of": pa.nulls(n, pa.string()),
        }
    )


def test_requests_render_chat_template_and_order_by_prefix(tokenizer):
    texts = ["beta report " * 3, "alpha memo", "gamma " * 5, "delta"]
    requests, too_long = build_requests(
        reps(texts),
        PromptConfig(),
        SamplingConfig(max_tokens=16),
        RequestsConfig(),
        {"small": tokenizer},
        {"small": 1024},
    )
    assert too_long.num_rows == 0 and requests.num_rows == 4
    ids = requests["prompt_token_ids"].to_pylist()
    assert ids == sorted(ids)  # shared prefixes adjacent
    text = tokenizer.decode(ids[0])
    assert text.startswith("<|bos|><|system|>") and text.endswith("<|assistant|>\n")
    assert set(requests["max_tokens"].to_pylist()) == {16}


class TrimmingTemplate:
    """A chat template that changes the content it is given, as real templates may (`| trim`, `| upper`)."""

    def __init__(self, transform):
        self.transform = transform

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return "".join(f"<{m['role']}>{self.transform(m['content'])}</{m['role']}>" for m in messages) + "<assistant>"


@pytest.mark.parametrize("template", ["tiny model", str.strip, str.upper, lambda t: t])
def test_prompts_rendered_around_a_marker_equal_full_renders(tokenizer, template):
    prompt = PromptConfig()
    tok = tokenizer if template == "tiny model" else TrimmingTemplate(template)
    for texts in (["alpha memo", "Revenue rose 5%.", "gamma " * 5 + "end"], ["  padded  ", "x"]):
        expected = [
            tok.apply_chat_template(render_messages(t, prompt), tokenize=False, add_generation_prompt=True)
            for t in texts
        ]
        assert render_prompts(tok, texts, prompt) == expected


def test_prompt_that_does_not_fit_is_too_long_and_output_budget_is_capped(tokenizer):
    requests, too_long = build_requests(
        reps(["word " * 400, "short"]),
        PromptConfig(),
        SamplingConfig(max_tokens=500),
        RequestsConfig(),
        {"small": tokenizer},
        {"small": 256},
    )
    assert too_long["id"].to_pylist() == ["d0"] and "context is 256" in too_long["detail"][0].as_py()
    (prompt,) = requests["prompt_token_ids"].to_pylist()
    assert requests["max_tokens"].to_pylist() == [256 - len(prompt)]


def completions(rows):
    return pa.Table.from_pylist(
        [dict(zip(["id", "tier", "prompt_tokens", "cached_prompt_tokens", "output_tokens"], r)) for r in rows]
    )


TIERS = {
    "small": TierConfig(model="m", price_per_gpu_hour=1.0, gpus=1),
    "large": TierConfig(model="M", price_per_gpu_hour=1.0, gpus=4),
}


def test_baseline_uses_the_largest_tier_rate_without_prefix_cache():
    comp = completions([("a", "small", 100, 50, 50), ("b", "large", 100, 0, 100)])
    gpu = np.array([1.0, 8.0])  # large: 8 GPU-s for 200 weight = 0.04 per token
    base = baseline_gpu_seconds(comp, gpu, "large", CostConfig())
    np.testing.assert_allclose(base, [150 * 0.04, 200 * 0.04])


def test_decode_steps_estimate():
    from pipeline.output.telemetry import decode_steps

    assert decode_steps(0, 10, 64) == 0
    assert decode_steps(64, 47.2, 64) == 48
    assert decode_steps(65, 10, 64) == 20


def test_lost_work_is_only_what_a_dead_worker_measured_and_never_stored():
    """Reproducer (red team): a SIGKILL and a rerun left 23 ledger rows of kind `lost` carrying about 1e-16
    GPU-seconds each: float residue of busy - recorded presented to analysts as lost work."""
    from types import SimpleNamespace

    from pipeline.generate.pricing import LOST_EPSILON_SECONDS, session_shares

    def session(sid, busy, recorded):
        return SimpleNamespace(
            session_id=sid, startup_seconds=2.0, busy_seconds=busy, idle_seconds=1.0, gpus=2, recorded_seconds=recorded
        )

    recorded = 0.1 + 0.2 + 0.3  # 0.6000000000000001: the sum of a session's shared busy intervals
    sessions = [session("residue", 0.6, recorded - 3e-16), session("killed", 1.1, recorded), session("idle", 0.5, 0.0)]
    shares = session_shares(sessions, {"residue": recorded, "killed": recorded}, stale=lambda s: True)
    assert shares["residue"].lost == 0.0 and LOST_EPSILON_SECONDS > 1e-12
    assert shares["killed"].lost == pytest.approx((1.1 - recorded) * 2, abs=1e-12)  # its measured, unstored busy time
    assert shares["idle"].lost == shares["idle"].held  # recorded nothing: all it held
    for s in ("residue", "killed"):  # whatever is not lost is shared over what was recorded: the ledger adds up
        share = shares[s]
        assert recorded * (1 + share.overhead_ratio) + share.lost == pytest.approx(share.held, rel=1e-12)
