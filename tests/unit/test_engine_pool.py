"""The engine pool (pipeline/generate/engine.py): one engine per way of running a tier, started on first use."""

from pipeline.generate.engine import EnginePool


def test_a_tier_repriced_or_served_under_another_name_keeps_its_engine_and_another_engine_setting_does_not(
    make_config,
):
    first = EnginePool(make_config().tiers).engine("small")
    renamed = make_config(tiers__small__price_per_gpu_hour=9.5, tiers__small__served_model_names=["gpt-4o-mini"])
    assert EnginePool(renamed.tiers).engine("small") is first
    other = make_config(tiers__small__fake__output_tokens=7)
    assert EnginePool(other.tiers).engine("small") is not first
