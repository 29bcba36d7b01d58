"""How close each tier's engine came to the hardware's limits, as gpt-fast and nanoGPT report it.

- Model FLOPs utilisation (MFU): 2 × parameters × tokens processed (uncached prompt + output), over
  engine seconds × GPUs × the GPU's dense peak for the weights' dtype. Attention FLOPs are left out,
  so MFU reads slightly low for long contexts.
- Memory-bandwidth utilisation (MBU): decode reads every weight once per engine step. Steps are
  estimated as, per engine call, ceil(items / max_num_seqs) × mean output tokens; weight bytes come
  from the checkpoint's safetensors headers. KV-cache reads are left out, so MBU reads low.
Both need the tier's `gpu_model` (see GPU_PEAKS); CPU tiers report tokens per second only.
"""

from __future__ import annotations

import json
import math
import struct
from functools import lru_cache
from pathlib import Path

# Dense (no sparsity) peaks from NVIDIA's datasheets: HBM bytes/s, and FLOP/s per weight dtype class.
GPU_PEAKS = {
    "H200": {"bandwidth": 4.8e12, "flops": {"16bit": 989e12, "8bit": 1979e12}},
    "H100-SXM": {"bandwidth": 3.35e12, "flops": {"16bit": 989e12, "8bit": 1979e12}},
    "H100-PCIE": {"bandwidth": 2.0e12, "flops": {"16bit": 756e12, "8bit": 1513e12}},
    "A100-80GB": {"bandwidth": 2.039e12, "flops": {"16bit": 312e12, "8bit": 624e12}},
    "L40S": {"bandwidth": 0.864e12, "flops": {"16bit": 181e12, "8bit": 362e12}},
    "L4": {"bandwidth": 0.3e12, "flops": {"16bit": 121e12, "8bit": 242e12}},
}
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


def efficiency(gpu_model: str | None, model_path: str, gpus: int, max_num_seqs: int | None, engine: dict) -> dict:
    """Achieved fractions of the GPU's limits for one tier's engine totals (see module doc)."""
    seconds = engine.get("engine_seconds") or 0.0
    out = {"gpu_model": gpu_model, "mfu": None, "mbu": None}
    size = checkpoint_size(model_path)
    if not gpu_model or gpu_model not in GPU_PEAKS or not size or not seconds:
        out["note"] = (
            "unknown GPU model: set tiers.<name>.gpu_model to one of " + ", ".join(GPU_PEAKS)
            if gpu_model not in GPU_PEAKS
            else "no engine time or no safetensors checkpoint"
        )
        return out
    params, weight_bytes = size
    peak = GPU_PEAKS[gpu_model]
    dtype_class = "8bit" if weight_bytes <= params * 1.01 else "16bit"
    tokens = engine.get("uncached_prompt_tokens", 0) + engine.get("output_tokens", 0)
    out["mfu"] = 2 * params * tokens / (seconds * gpus * peak["flops"][dtype_class])
    steps = engine.get("decode_steps_estimate", 0)
    out["mbu"] = weight_bytes * steps / (seconds * gpus * peak["bandwidth"])
    out["note"] = f"{params / 1e9:.2f} B parameters, {weight_bytes / 2**30:.1f} GiB of weights, {dtype_class} peak"
    return out


def decode_steps(items: int, mean_output_tokens: float, max_num_seqs: int | None) -> int:
    """Engine steps one call needs to decode `items` sequences, at most `max_num_seqs` at a time."""
    return math.ceil(items / (max_num_seqs or 256)) * math.ceil(mean_output_tokens) if items else 0
