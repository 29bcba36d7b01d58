"""The break-even against API batch offers (pipeline/plan/breakeven.py) on a hand-computed case, and its inputs."""

import json

import pytest

from pipeline.plan import breakeven, whatif


def tier(**kw):
    """One tier, one request per document, 100 requests/s of busy time, 360 s start-up, 90% utilisation, 2 GPUs
    at $3 a GPU-hour; requests of 1,000 prompt and 100 output tokens."""
    args = dict(
        name="large",
        items_per_doc=1.0,
        prompt=1000.0,
        output=100.0,
        busy=lambda items: items / 100,
        startup_seconds=360.0,
        utilisation=0.9,
        gpus=2,
        price_per_gpu_hour=3.0,
    )
    return breakeven.TierLoad(**{**args, **kw})


API = {"offer": {"input": 0.10, "cached_input": 0.01, "output": 0.40}}


def test_break_even_on_a_hand_computed_case():
    # A night of N documents: (360 + N / 100 / 0.9) s × 2 GPUs × $3 / 3600 = $0.60 + N × $1/54,000.
    # The API: 1,000 × $0.10 / 1M + 100 × $0.40 / 1M = $0.00014 a document.
    # Break-even: 0.60 = N × (0.00014 - 1/54,000), N = 4,939.0.
    t = tier()
    assert breakeven.night_usd([t], 54_000) == pytest.approx(0.60 + 1.0)
    f = breakeven.mix_figures([t], job_docs=100, volume=1_000_000, api=API, cached=0.0)
    assert f["api"]["offer"]["usd_per_1k_documents"] == pytest.approx(0.14)
    assert f["api"]["offer"]["break_even_documents"] == pytest.approx(0.60 / (0.00014 - 1 / 54_000), rel=1e-6)
    assert f["usd_per_1k_documents_at_job"] == pytest.approx((0.60 + 100 / 54_000) / 100 * 1000)
    assert f["usd_per_1k_documents_at_volume"] == pytest.approx((0.60 + 1e6 / 54_000) / 1e6 * 1000)
    assert f["api"]["offer"]["ratio_at_volume"] == pytest.approx((0.60 + 1e6 / 54_000) / 140)
    assert f["fixed_usd_per_night"] == pytest.approx(0.60)
    assert f["gpu_hours_per_night_at_volume"] == pytest.approx((360 + 1e6 / 90) * 2 / 3600)


def test_cached_prompt_tokens_reuse_and_reserved_gpus_move_the_break_even():
    # Half the prompt at the cached price: 500 × 0.10 + 500 × 0.01 + 100 × 0.40 = $0.000095 a document.
    t = tier()
    cached = breakeven.mix_figures([t], 100, 1000, API, cached=0.5)["api"]["offer"]
    assert cached["break_even_documents"] == pytest.approx(0.60 / (0.000095 - 1 / 54_000), rel=1e-6)
    # Reuse: half the documents answered by a duplicate halves the requests per document, on both sides.
    half = breakeven.mix_figures([tier(items_per_doc=0.5)], 100, 1000, API, 0.0)["api"]["offer"]
    assert half["break_even_documents"] == pytest.approx(0.60 / (0.00007 - 0.5 / 54_000), rel=1e-6)
    # A reserved GPU is paid 24 h whatever it runs: $144 a night until the work needs more.
    reserved = tier(billed_seconds=86400.0)
    assert breakeven.night_usd([reserved], 1000) == pytest.approx(144.0)
    f = breakeven.mix_figures([reserved], 100, 1000, API, 0.0)["api"]["offer"]
    assert f["break_even_documents"] == pytest.approx(144.0 / 0.00014, rel=1e-6)
    # Self-hosting that costs more per document than the API never breaks even.
    assert breakeven.break_even([tier(busy=lambda items: items)], 0.00014) is None


@pytest.mark.parametrize(
    ("text", "documents"),
    [("100000", 100_000), ("100k/night", 100_000), ("2.5M", 2_500_000), ("1e6 / night", 1_000_000)],
)
def test_volume_is_documents_per_night(text, documents):
    assert breakeven.parse_volume(text) == documents


@pytest.mark.parametrize("text", ["", "lots", "-5", "0", "1e13", "5/week"])
def test_a_volume_that_is_not_one_is_refused_clearly(text):
    with pytest.raises(ValueError, match="--volume"):
        breakeven.parse_volume(text)


def test_the_price_file_is_dated_and_has_every_price(tmp_path):
    table, date = whatif.load_prices()
    assert date == "2026-12-05" and {"openai gpt-4o-mini (batch)", "anthropic claude-haiku-4.5 (batch)"} <= set(table)
    assert all(p["cached_input"] <= p["input"] < p["output"] for p in table.values())
    edited = tmp_path / "prices.json"
    edited.write_text(json.dumps({"date": "2027-01-01", "prices": {"x": {"input": 1, "output": 2}}}))
    assert whatif.load_prices(edited) == ({"x": {"input": 1, "cached_input": 1, "output": 2}}, "2027-01-01")
    edited.write_text(json.dumps({"x": {"input": "cheap", "output": 2}}))
    with pytest.raises(ValueError, match="offer 'x' needs numbers"):
        whatif.load_prices(edited)
