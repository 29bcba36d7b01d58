"""A tier's throughput from first principles: what its model must move and compute, over what its device can.

The model's shape comes from its own config.json (or PRESETS, for models not on this machine), the batch
from the tier's `max_num_seqs` and the staged requests, the device from output/devices.py (GPU datasheets,
or this CPU's measured limits). A job's busy time is then
  prefill  compute-bound: 2 × params × prompt tokens (+ attention) / (peak FLOP/s × COMPUTE_EFFICIENCY)
  decode   per engine step: the weight bytes plus the KV cache the batch reads, / (bandwidth × efficiency),
           plus 2 × params × batch FLOPs / (FLOP/s × efficiency), plus a fixed step overhead; steps =
           output tokens / batch (/ tokens per step under speculative decoding).
The memory and compute terms of a step are added, not overlapped: at the batches offline jobs run both are
of a size, and the sum is what the published figures (docs/estimate.md) fit.

The efficiency factors are chosen once, for all rows of the calibration (CALIBRATION, checked by
tests/unit/test_hardware.py and benchmarks/hardware_projection.py), never per model or row.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from pipeline.output.devices import GPU_PEAKS, cpu_peaks

# Shares of the datasheet peaks vLLM-class engines reach on GPUs (calibrated once against CALIBRATION).
GPU_EFFICIENCY = {"bandwidth": 0.75, "compute": 0.55, "step_seconds": 0.004}
# On a CPU, of the limits the probe measured. vLLM's CPU path runs eager PyTorch with a Python scheduler, and the
# tier worker accounts for every step: a fixed 0.25 s per step on 2 shared cores, which dominates small models
# (fit once on the tiny model's no-ledger job, checked on the two-tier job: benchmarks/RESULTS.md §13). Prefill
# is the probe's own kind of work, large float32 matmuls (up to max_num_batched_tokens rows at once), so it runs
# at the probe's rate: at 0.5 the long-document corpus's prefill was projected at 82 s of a job whose busy time
# was 58.5 s in all (RESULTS §13, 2026-12-05).
CPU_EFFICIENCY = {"bandwidth": 0.5, "compute": 0.5, "prefill_compute": 1.0, "step_seconds": 0.25}
# Per lever, what it changes besides bytes and FLOP class: W4A16 kernels dequantise on the fly (declared, not
# calibrated: no published INT4 row was found).
LEVER_BANDWIDTH_EFFICIENCY = {"int4": 0.8}
DEFAULT_MAX_NUM_SEQS = 256  # vLLM's default
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of GPU memory, for how many sequences fit
SPECULATIVE_TOKENS = 4  # drafted per step when a lever gives only the acceptance


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer as its config.json describes it; bits: weights and KV cache as stored."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = False
    weight_bits: int = 16
    kv_bits: int = 16

    @property
    def layer_params(self) -> int:
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return attention + 3 * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def params(self) -> int:
        """Parameters stored (the embedding once when tied to the output head)."""
        return self.layers * self.layer_params + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def compute_params(self) -> int:
        """Parameters each token multiplies through: the layers and the output head (embedding lookups are free)."""
        return self.layers * self.layer_params + self.vocab * self.hidden

    @property
    def weight_bytes(self) -> float:
        """Bytes a decode step reads: the layers at the weights' width; the output head stays 16-bit when the
        layers are quantised (as quantisation recipes leave it)."""
        head = self.vocab * self.hidden * min(max(self.weight_bits, 16), 32) / 8
        return self.layers * self.layer_params * self.weight_bits / 8 + head

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_bits / 8


# Config numbers of models a what-if may name without their files (from each model's config.json on the Hub).
PRESETS = {
    "Llama-3.1-8B": ModelShape(32, 4096, 32, 8, 128, 14336, 128256),
    "Llama-3.1-70B": ModelShape(80, 8192, 64, 8, 128, 28672, 128256),
    "Llama-2-13B": ModelShape(40, 5120, 40, 40, 128, 13824, 32000),
    "Llama-2-70B": ModelShape(80, 8192, 64, 8, 128, 28672, 32000),
    "SmolLM2-135M": ModelShape(30, 576, 9, 3, 64, 1536, 49152, tied=True),
}
_DTYPE_BITS = {"float32": 32, "float": 32, "bfloat16": 16, "float16": 16, "half": 16, "fp8": 8, "int8": 8, "int4": 4}


def preset(name: str) -> ModelShape | None:
    """A preset by name, case-insensitive, with or without an org prefix (`meta-llama/Llama-3.1-8B-Instruct`)."""
    key = name.rsplit("/", 1)[-1].lower().removesuffix("-instruct")
    return next((s for n, s in PRESETS.items() if n.lower() == key), None)


def _quantised_bits(q: dict) -> int | None:
    """Weight bits of a checkpoint's quantization_config (compressed-tensors, GPTQ/AWQ, FP8)."""
    if q.get("bits"):
        return int(q["bits"])
    if q.get("quant_method") == "fp8":
        return 8
    for group in (q.get("config_groups") or {}).values():
        bits = (group.get("weights") or {}).get("num_bits")
        if bits:
            return int(bits)
    return None


def read_shape(model: str | Path) -> ModelShape | None:
    """A model's shape from `model`/config.json (or a config.json path), else a preset of that name, else None."""
    path = Path(str(model)).expanduser()
    path = path if path.name == "config.json" else path / "config.json"
    try:
        c = json.loads(path.read_text())
    except (OSError, ValueError):
        return preset(str(model))
    c = c.get("text_config", c)
    heads = c.get("num_attention_heads")
    if not heads or not c.get("hidden_size") or not c.get("num_hidden_layers"):
        return None
    dtype = str(c.get("torch_dtype") or c.get("dtype") or "bfloat16")
    bits = _quantised_bits(c.get("quantization_config") or {}) or _DTYPE_BITS.get(dtype, 16)
    return ModelShape(
        layers=c["num_hidden_layers"],
        hidden=c["hidden_size"],
        heads=heads,
        kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        intermediate=c.get("intermediate_size") or 4 * c["hidden_size"],
        vocab=c.get("vocab_size", 32000),
        tied=bool(c.get("tie_word_embeddings", False)),
        weight_bits=bits,
        kv_bits=_DTYPE_BITS.get(dtype, 16),  # the KV cache is kept at the activations' width
    )


@dataclass(frozen=True)
class Device:
    """What a tier's engine runs on: peaks (GPU_PEAKS' form), how many, and the efficiency set that applies."""

    name: str
    peaks: dict
    count: int = 1
    efficiency: dict = None  # type: ignore[assignment]
    kv_capacity_bytes: float | None = None  # None: the GPUs' memory less the weights

    def flops(self, bits: int) -> float:
        f = self.peaks["flops"]
        cls = "8bit" if bits <= 8 and "8bit" in f else ("32bit" if bits > 16 and "32bit" in f else "16bit")
        return f.get(cls, f.get("16bit", 0.0)) * self.count


def gpu(name: str, count: int = 1) -> Device:
    return Device(name, GPU_PEAKS[name], count, GPU_EFFICIENCY)


def cpu(home=None, probe=None, kv_gib: float = 1.0) -> Device:
    """This machine's CPU as a device: the probe's limits (cached), CPU_EFFICIENCY, `kv_gib` of KV cache."""
    return Device("cpu", cpu_peaks(home, probe), 1, CPU_EFFICIENCY, kv_gib * 2**30)


@dataclass(frozen=True)
class Workload:
    """What a tier runs: `items` requests of `prompt` and `output` mean tokens, at most `max_num_seqs` at once;
    `compute_bits`: the activations' width (weights-only quantisation computes at 16 bits); speculative decoding
    at `acceptance` of `draft_tokens` drafted per step (0: off)."""

    items: float
    prompt: float
    output: float
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    compute_bits: int | None = None
    acceptance: float = 0.0
    draft_tokens: int = SPECULATIVE_TOKENS


@dataclass(frozen=True)
class Projection:
    prefill_seconds: float
    decode_seconds: float
    steps: float
    batch: float

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds


def tokens_per_step(acceptance: float, drafted: int) -> float:
    """Expected tokens a sequence advances per verification step (Leviathan et al. 2023, eq. 1)."""
    if acceptance <= 0:
        return 1.0
    if acceptance >= 1:
        return drafted + 1.0
    return (1 - acceptance ** (drafted + 1)) / (1 - acceptance)


def batch_size(shape: ModelShape, device: Device, w: Workload) -> float:
    """Sequences decoding at once: max_num_seqs, the items there are, and what the KV cache holds."""
    capacity = device.kv_capacity_bytes
    if capacity is None:
        capacity = device.peaks.get("memory", 80e9) * device.count * GPU_MEMORY_UTILIZATION - shape.weight_bytes
    fits = max(capacity, 0.0) / max(shape.kv_bytes_per_token * (w.prompt + w.output), 1.0)
    return max(min(float(w.max_num_seqs), max(w.items, 1.0), fits), 1.0)


def project(shape: ModelShape, device: Device, w: Workload, lever: str | None = None) -> Projection:
    """Busy engine seconds of workload `w` for a model of `shape` on `device` (module doc)."""
    eff = device.efficiency
    bits = w.compute_bits or shape.weight_bits
    flops = device.flops(bits) * eff["compute"]
    bandwidth = device.peaks["bandwidth"] * device.count * eff["bandwidth"] * LEVER_BANDWIDTH_EFFICIENCY.get(lever, 1)
    attention = 2 * shape.layers * shape.heads * shape.head_dim  # FLOPs per token per token of context (QK, AV)
    prefill_flops = device.flops(bits) * eff.get("prefill_compute", eff["compute"])
    prefill = w.items * (2 * shape.compute_params * w.prompt + attention * w.prompt**2) / prefill_flops
    batch = batch_size(shape, device, w)
    per_step = 1 + (w.draft_tokens if w.acceptance > 0 else 0)  # tokens each sequence verifies per step
    context = w.prompt + w.output / 2
    steps = w.items * w.output / (batch * tokens_per_step(w.acceptance, w.draft_tokens))
    step = (
        eff["step_seconds"]
        + (shape.weight_bytes + batch * context * shape.kv_bytes_per_token) / bandwidth
        + batch * per_step * (2 * shape.compute_params + attention * context) / flops
    )
    return Projection(prefill, steps * step, steps, batch)


LEVERS = ("fp8", "int4", "kv-fp8", "spec")


def with_lever(shape: ModelShape, lever: str) -> ModelShape:
    """The model with one lever applied: FP8 or INT4 weights, or an FP8 KV cache (speculation: see Workload)."""
    if lever == "fp8":
        return replace(shape, weight_bits=8)
    if lever == "int4":
        return replace(shape, weight_bits=4)
    if lever == "kv-fp8":
        return replace(shape, kv_bits=8)
    return shape


def compute_bits_for(shape: ModelShape, levers: set[str]) -> int | None:
    """Weights-only INT4 (W4A16) computes at 16 bits; FP8 and INT8 W8A8 at 8; otherwise the weights' width."""
    return 16 if "int4" in levers or shape.weight_bits == 4 else None


def startup_seconds(shape: ModelShape, device: Device) -> float:
    """An engine's start-up and idle per job: process and kernels (CPU eager about 40 s, GPU with CUDA graphs
    about 60 s, as measured here and reported for vLLM), weights loaded at about 2 GB/s, and the 5 s vLLM waits for
    its engine process at shutdown. Declared (CPU: 40-60 s measured for the tiny models on 2 shared cores), not
    measured per model."""
    base = 40.0 if device.name == "cpu" else 60.0
    return base + shape.weight_bytes / 2e9 + 5.0


# Speculative decoding's acceptance where none is measured or stated (n-gram drafts: 76-83% measured here).
DEFAULT_ACCEPTANCE = 0.7


def tier_shape(tier) -> tuple[ModelShape, set[str]] | None:
    """A tier's model as its engine runs it (`vllm.dtype`, online `quantization`, `kv_cache_dtype`) and the levers
    on; None when its config.json is not readable and no preset matches."""
    shape = read_shape(tier.model)
    if shape is None:
        return None
    v, levers = tier.vllm, set()
    if v.dtype and shape.weight_bits >= 16:
        bits = _DTYPE_BITS.get(v.dtype, shape.weight_bits)
        shape = replace(shape, weight_bits=bits, kv_bits=bits)
    if v.quantization == "fp8":
        shape, levers = replace(shape, weight_bits=8), levers | {"fp8"}
    elif shape.weight_bits == 4:
        levers.add("int4")
    if (v.kv_cache_dtype or "").startswith("fp8"):
        shape, levers = replace(shape, kv_bits=8), levers | {"kv-fp8"}
    if v.speculative_config is not None:
        levers.add("spec")
    return shape, levers


def tier_device(tier, home=None, probe=None) -> Device | None:
    """Where a tier runs: this CPU (measured), or its `gpu_model` × `gpus`; None for a GPU tier of unknown model."""
    if tier.device == "cpu":
        return cpu(home, probe, tier.cpu_kvcache_space_gib)
    return gpu(tier.gpu_model, tier.gpus) if tier.gpu_model in GPU_PEAKS else None


def tier_workload(tier, shape: ModelShape, levers: set[str], items: float, prompt: float, output: float) -> Workload:
    spec = tier.vllm.speculative_config
    return Workload(
        items,
        prompt,
        output,
        tier.vllm.max_num_seqs or DEFAULT_MAX_NUM_SEQS,
        compute_bits_for(shape, levers),
        DEFAULT_ACCEPTANCE if spec is not None else 0.0,
        (spec.num_speculative_tokens or SPECULATIVE_TOKENS) if spec is not None else SPECULATIVE_TOKENS,
    )


# -- calibration: published throughput against the projection (docs/estimate.md) -----------------------------------

CALIBRATION = (
    # source, url, device, GPUs, model preset, weight bits, kv bits, batch, prompt, output, published output tok/s
    (
        "MLPerf Inference v5.1, Red Hat (vLLM 0.10.0), Offline",
        "https://www.redhat.com/en/blog/efficient-and-reproducible-llm-inference-red-hat-mlperf-inference-v51-results",
        "H100-SXM",
        1,
        "Llama-3.1-8B",
        8,
        16,
        512,
        780,
        128,
        5777.0,
    ),
    (
        "MLPerf Inference v5.1, Red Hat (vLLM 0.10.0), Offline",
        "https://www.redhat.com/en/blog/efficient-and-reproducible-llm-inference-red-hat-mlperf-inference-v51-results",
        "L40S",
        1,
        "Llama-3.1-8B",
        8,
        16,
        512,
        780,
        128,
        1642.0,
    ),
    *(
        (
            "TensorRT-LLM v0.5 H200 launch (max throughput)",
            "https://github.com/NVIDIA/TensorRT-LLM/blob/main/docs/source/blogs/H200launch.md",
            "H200",
            gpus,
            model,
            8,
            8,
            batch,
            prompt,
            output,
            published,
        )
        for model, batch, gpus, prompt, output, published in (
            ("Llama-2-13B", 1024, 1, 128, 128, 11819.0),
            ("Llama-2-13B", 128, 1, 128, 2048, 4750.0),
            ("Llama-2-13B", 64, 1, 2048, 128, 1349.0),
            ("Llama-2-70B", 512, 1, 128, 128, 3014.0),
            ("Llama-2-70B", 64, 1, 2048, 128, 341.0),
            ("Llama-2-70B", 32, 1, 2048, 128, 303.0),
        )
    ),
)


def calibration_rows() -> list[dict]:
    """Each CALIBRATION row with its projected output tokens/s per GPU and the ratio projected / published."""
    rows = []
    for source, url, device, gpus, model, wbits, kvbits, batch, prompt, output, published in CALIBRATION:
        shape = replace(PRESETS[model], weight_bits=wbits, kv_bits=kvbits)
        w = Workload(items=batch * 8, prompt=prompt, output=output, max_num_seqs=batch)
        p = project(shape, gpu(device, gpus), w)
        projected = w.items * w.output / p.seconds / gpus
        rows.append(
            {
                "source": source,
                "url": url,
                "hardware": f"{gpus}× {device}",
                "model": model,
                "precision": f"W{wbits} KV{kvbits}",
                "batch": batch,
                "prompt": prompt,
                "output": output,
                "published": published,
                "projected": round(projected, 1),
                "ratio": round(projected / published, 3),
            }
        )
    return rows
