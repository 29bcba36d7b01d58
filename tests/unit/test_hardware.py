"""The hardware prior (pipeline/plan/hardware.py): roofline arithmetic checked against hand computation, the
calibration against published figures, the CPU probe's cache, the estimate with no ledger, and CPU efficiency.
No test here times this machine: every CPU probe is injected."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pipeline.output.devices import PROBE_FILE, cpu_peaks
from pipeline.plan import hardware
from pipeline.plan.hardware import PRESETS, Workload, gpu, project

LLAMA8 = PRESETS["Llama-3.1-8B"]
FAKE_CPU = {"bandwidth": 10e9, "flops": {"32bit": 100e9, "16bit": 100e9, "8bit": 100e9}}


def test_llama_3_1_8b_shape_by_hand():
    # per layer: q, o 4096×4096; k, v 4096×1024; MLP 3 × 4096×14336; two norms
    layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    assert LLAMA8.layer_params == layer == 218_112_000
    assert LLAMA8.params == 32 * layer + 2 * 128256 * 4096 + 4096 == 8_030_261_248  # the published 8.03 B
    assert LLAMA8.compute_params == 32 * layer + 128256 * 4096
    assert LLAMA8.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131_072  # K and V, 32 layers, 8 KV heads, bf16
    assert PRESETS["Llama-3.1-70B"].params == pytest.approx(70.55e9, rel=1e-3)
    assert PRESETS["SmolLM2-135M"].params == pytest.approx(134.5e6, rel=1e-3)


def test_decode_step_time_by_hand():
    """Llama-3.1-8B bf16 on one H100-SXM, 64 sequences of 1,000 prompt and 100 output tokens."""
    w = Workload(items=64, prompt=1000, output=100, max_num_seqs=64)
    p = project(LLAMA8, gpu("H100-SXM"), w)
    weights = 2 * LLAMA8.compute_params  # 15.0 GB read per step
    kv = 64 * 1050 * 131_072  # the batch's cache at the mean context, 8.8 GB
    memory = (weights + kv) / (3.35e12 * 0.75)
    flops = 64 * (2 * LLAMA8.compute_params + 2 * 32 * 32 * 128 * 1050) / (989e12 * 0.55)
    step = 0.004 + memory + flops
    assert p.batch == 64 and p.steps == pytest.approx(100)
    assert p.decode_seconds == pytest.approx(100 * step, rel=1e-9)
    # 9.5 ms of memory, 1.8 ms of compute, 4 ms of overhead: about 4,200 output tok/s for the batch
    assert step == pytest.approx(0.0153, abs=2e-4)


def test_prefill_is_compute_bound_by_hand():
    w = Workload(items=10, prompt=2000, output=1)
    p = project(LLAMA8, gpu("H200"), w)
    per_seq = 2 * LLAMA8.compute_params * 2000 + 2 * 32 * 32 * 128 * 2000**2
    assert p.prefill_seconds == pytest.approx(10 * per_seq / (989e12 * 0.55), rel=1e-9)
    fp8 = project(hardware.with_lever(LLAMA8, "fp8"), gpu("H200"), w)  # 8-bit weights: the FP8 tensor-core rate
    assert fp8.prefill_seconds == pytest.approx(p.prefill_seconds / 2, rel=1e-3)  # 1,979 vs 2 × 989 TFLOP/s


def test_fp8_halves_the_layers_bytes_and_fp8_kv_halves_the_cache():
    fp8 = hardware.with_lever(LLAMA8, "fp8")
    head = 128256 * 4096 * 2  # the output head stays 16-bit, as quantisation recipes leave it
    assert fp8.weight_bytes - head == pytest.approx((LLAMA8.weight_bytes - head) / 2)
    assert hardware.with_lever(LLAMA8, "int4").weight_bytes - head == pytest.approx((LLAMA8.weight_bytes - head) / 4)
    assert hardware.with_lever(LLAMA8, "kv-fp8").kv_bytes_per_token == LLAMA8.kv_bytes_per_token / 2
    w = Workload(items=512, prompt=100, output=500, max_num_seqs=512)
    assert project(fp8, gpu("H100-SXM"), w).seconds < project(LLAMA8, gpu("H100-SXM"), w).seconds


def test_speculative_decoding_advances_more_tokens_per_step():
    assert hardware.tokens_per_step(0.0, 4) == 1.0
    assert hardware.tokens_per_step(0.5, 4) == pytest.approx(1 + 0.5 + 0.25 + 0.125 + 0.0625)
    w = Workload(items=8, prompt=100, output=200, max_num_seqs=8)
    spec = replace(w, acceptance=0.8)
    assert project(LLAMA8, gpu("L4"), spec).steps == pytest.approx(
        project(LLAMA8, gpu("L4"), w).steps / hardware.tokens_per_step(0.8, 4)
    )


def test_kv_cache_capacity_bounds_the_batch():
    w = Workload(items=4096, prompt=4000, output=1000, max_num_seqs=4096)
    fits = (80e9 * 0.9 - LLAMA8.weight_bytes) / (LLAMA8.kv_bytes_per_token * 5000)
    assert project(LLAMA8, gpu("H100-SXM"), w).batch == pytest.approx(fits)


def test_calibration_rows_stay_within_30_percent():
    """Fails when an efficiency factor moves a published row out of ±30% (docs/estimate.md)."""
    rows = hardware.calibration_rows()
    assert len(rows) >= 8
    outside = [f"{r['hardware']} {r['model']} {r['prompt']}/{r['output']}: {r['ratio']}" for r in rows]
    assert all(0.7 <= r["ratio"] <= 1.3 for r in rows), outside


def test_read_shape_from_a_config_json(tmp_path):
    config = {
        "num_hidden_layers": 4,
        "hidden_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "intermediate_size": 256,
        "vocab_size": 2048,
        "torch_dtype": "float32",
        "quantization_config": {"config_groups": {"g": {"weights": {"num_bits": 8}}}},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = hardware.read_shape(tmp_path)
    assert (shape.layers, shape.kv_heads, shape.weight_bits, shape.kv_bits) == (4, 2, 8, 32)
    assert hardware.read_shape("meta-llama/Llama-3.1-8B-Instruct") == LLAMA8  # a preset, no download
    assert hardware.read_shape(tmp_path / "nothing-here") is None


def test_the_cpu_probe_is_cached_and_reused(tmp_path):
    calls = []

    def probe():
        calls.append(1)
        return FAKE_CPU

    first = cpu_peaks(tmp_path, probe)
    again = cpu_peaks(tmp_path, probe)
    assert len(calls) == 1 and first == again and first["bandwidth"] == 10e9
    cached = json.loads((tmp_path / PROBE_FILE).read_text())
    cached["identity"] = "another-host|another cpu|64"  # another machine's result is measured again
    (tmp_path / PROBE_FILE).write_text(json.dumps(cached))
    cpu_peaks(tmp_path, probe)
    assert len(calls) == 2


def test_no_ledger_estimate_uses_the_projection_with_a_range_at_most_4x(make_config, tmp_path):
    from pipeline.plan.estimate import Demand, price_demand, with_priors
    from pipeline.plan.rates import tier_rates

    config = make_config(engine="vllm")  # the tiny models' real config.json; nothing starts
    demand = Demand()
    demand.add(["small"] * 40, [500] * 40, ["acme"] * 40)
    rates = with_priors(config, tier_rates(config, config.output.uri), demand, tmp_path, lambda: FAKE_CPU)
    small = rates["small"]
    assert small.method.startswith("projection (no ledger") and "cpu" in small.method
    priced = price_demand(demand, config, rates)
    assert priced["tiers"]["small"]["method"] == small.method
    assert 0 < priced["est_usd_low"] < priced["est_usd"] < priced["est_usd_high"] <= 4 * priced["est_usd_low"]
    # The midpoint is the projection: busy seconds of the workload plus the declared start-up, at the tier's price.
    shape, levers = hardware.tier_shape(config.tiers["small"])
    device = hardware.cpu(tmp_path, lambda: FAKE_CPU)
    k = config.sampling.max_tokens
    busy = project(shape, device, hardware.tier_workload(config.tiers["small"], shape, levers, 40, 500, k)).seconds
    start = hardware.startup_seconds(shape, device)
    price = config.tiers["small"].price_per_gpu_hour / 3600
    assert priced["est_usd"] == pytest.approx((busy + start) * price, rel=1e-6)
    fake = make_config()  # the fake engine runs no model: the configured default stands
    assert with_priors(fake, tier_rates(fake), demand, tmp_path, lambda: FAKE_CPU)["small"].method.startswith(
        "configured default"
    )


def test_cpu_tier_efficiency_against_the_measured_limits(make_config, tmp_path):
    from pipeline.output.telemetry import checkpoint_size, tier_efficiency

    tier = make_config(engine="vllm").tiers["small"]
    engine = {
        "engine_seconds": 10.0,
        "uncached_prompt_tokens": 20_000,
        "output_tokens": 4_000,
        "decode_steps_estimate": 96,
    }
    e = tier_efficiency(tier, engine, tmp_path, lambda: FAKE_CPU)
    params, weight_bytes = checkpoint_size(tier.model)
    assert e["mfu"] == pytest.approx(2 * params * 24_000 / (10.0 * 100e9))
    assert e["mbu"] == pytest.approx(weight_bytes * 96 / (10.0 * 10e9))
    assert e["device"] == "this CPU, as measured" and "32bit" in e["note"]
    fake = tier_efficiency(make_config().tiers["small"], engine, tmp_path, lambda: FAKE_CPU)
    assert fake["mfu"] is None and "fake" in fake["note"]
    # The job summary and the report say what it is measured against (`make demo` printed "(None)").
    from pipeline.cli.jobs import engine_line
    from pipeline.output.manifest import EngineFigures

    assert engine_line(EngineFigures(efficiency=e)).endswith(
        f"MFU {e['mfu']:.1%}, MBU {e['mbu']:.1%} (of this CPU, as measured)"
    )


def test_what_if_refuses_a_device_count_or_an_acceptance_that_cannot_be():
    """Reproducer: `--hardware H100-SXM:0` ended in a ZeroDivisionError traceback; `spec=1.7` was taken."""
    from pipeline.plan.whatif import parse_hardware, parse_tier

    for bad in ("H100-SXM:0", "H100-SXM:-2", "H100-SXM:x"):
        with pytest.raises(ValueError, match="at least 1"):
            parse_hardware(bad)
    assert parse_hardware("h100-sxm:8") == ("H100-SXM", 8)
    with pytest.raises(ValueError, match="between 0 and 1"):
        parse_tier("small=Llama-3.1-8B:spec=1.7")
