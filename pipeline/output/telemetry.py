"""How close each tier's engine came to the hardware's limits, as gpt-fast and nanoGPT report it.

- Model FLOPs utilisation (MFU): 2 × parameters × tokens processed (uncached prompt + output), over
  engine seconds × GPUs × the GPU's dense peak for the weights' dtype. Attention FLOPs are left out,
  so MFU reads slightly low for long contexts.
- Memory-bandwidth utilisation (MBU): decode reads every weight once per engine step. Steps are
  estimated as, per engine call, ceil(items / max_num_seqs) × mean output tokens; weight bytes come
  from the checkpoint's safetensors headers. KV-cache reads are left out, so MBU reads low.
Both divide by the device's peaks: a GPU tier's `gpu_model` (GPU_PEAKS, output/devices.py), or on a CPU tier this
machine's limits as the probe measured them (`devices.cpu_peaks`: memory bandwidth and float32 matmul FLOP/s),
so a CPU figure reads against what numpy reaches here, not a datasheet. The fake engine reports neither.
"""

from __future__ import annotations

import json
import math
import struct
from functools import lru_cache
from pathlib import Path

from pipeline.output.devices import GPU_PEAKS, cpu_peaks

__all__ = ["GPU_PEAKS", "checkpoint_size", "decode_steps", "efficiency", "tier_efficiency"]
_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}


@lru_cache(maxsize=16)
def checkpoint_size(model_path: str) -> tuple[int, int] | None:
    """(parameters, weight bytes) from the safetensors headers, without loading any weight."""
    files = sorted(Path(model_path).expanduser().glob("*.safetensors"))
    if not files:
        return None
    params = nbytes = 0
    for f in files:
        with open(f, "rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(length))
        for name, t in header.items():
            if name == "__metadata__":
                continue
            n = math.prod(t["shape"])
            params += n
            nbytes += n * _DTYPE_BYTES.get(t["dtype"], 2)
    return params, nbytes


def tier_efficiency(tier, engine: dict, home=None, probe=None) -> dict:
    """`efficiency` for a tier's config: its GPU model's peaks, or on a CPU tier this machine's measured limits
    (the cached probe: `home`, `probe` as devices.cpu_peaks). The fake engine runs no model: against a named GPU
    it gives the arithmetic (tests), against this CPU nothing."""
    if tier.device == "cpu" and not tier.gpu_model:
        if tier.engine != "vllm":
            return {"gpu_model": None, "mfu": None, "mbu": None, "note": "fake engine: no model runs"}
        peaks = cpu_peaks(home, probe)
        out = efficiency("cpu", tier.model, tier.gpus, tier.vllm.max_num_seqs, engine, peaks)
        out["gpu_model"], out["device"] = None, "this CPU, as measured"
        return out
    return efficiency(tier.gpu_model, tier.model, tier.gpus, tier.vllm.max_num_seqs, engine)


def device_name(eff: dict) -> str:
    """What an efficiency figure is measured against, for a sentence: `a H100-SXM`, or `this CPU, as measured`."""
    return eff.get("device") or f"a {eff['gpu_model']}"


def efficiency(
    gpu_model: str | None,
    model_path: str,
    gpus: int,
    max_num_seqs: int | None,
    engine: dict,
    peaks: dict | None = None,
) -> dict:
    """Achieved fractions of the device's limits for one tier's engine totals (see module doc): `peaks` when given
    (a CPU's measured ones), else GPU_PEAKS[gpu_model]."""
    seconds = engine.get("engine_seconds") or 0.0
    out = {"gpu_model": gpu_model, "mfu": None, "mbu": None}
    size = checkpoint_size(model_path)
    peak = peaks or GPU_PEAKS.get(gpu_model or "")
    if not peak or not size or not seconds:
        out["note"] = (
            "unknown GPU model: set tiers.<name>.gpu_model to one of " + ", ".join(GPU_PEAKS)
            if not peak
            else "no engine time or no safetensors checkpoint"
        )
        return out
    params, weight_bytes = size
    bytes_per_param = weight_bytes / params
    dtype_class = "8bit" if bytes_per_param <= 1.01 else "16bit" if bytes_per_param <= 2.01 else "32bit"
    dtype_class = dtype_class if dtype_class in peak["flops"] else "16bit"
    tokens = engine.get("uncached_prompt_tokens", 0) + engine.get("output_tokens", 0)
    out["mfu"] = 2 * params * tokens / (seconds * gpus * peak["flops"][dtype_class])
    steps = engine.get("decode_steps_estimate", 0)
    out["mbu"] = weight_bytes * steps / (seconds * gpus * peak["bandwidth"])
    out["note"] = f"{params / 1e9:.2f} B parameters, {weight_bytes / 2**30:.1f} GiB of weights, {dtype_class} peak"
    return out


def decode_steps(items: int, mean_output_tokens: float, max_num_seqs: int | None) -> int:
    """Engine steps one call needs to decode `items` sequences, at most `max_num_seqs` at a time."""
    return math.ceil(items / (max_num_seqs or 256)) * math.ceil(mean_output_tokens) if items else 0
