"""LoRA adapters: one per tenant, served beside the base model in the tier's engine (config `tenants`).

An adapter is a peft folder (adapter_config.json + weights); its content digest (keys.adapter_digest)
is part of the item key of every request made with it.
"""

from __future__ import annotations

import json
from pathlib import Path

# vLLM's allowed LoRA ranks (vllm/config/lora.py MaxLoRARanks).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def adapter_rank(folder: str) -> int:
    """The LoRA rank `r` of a peft adapter folder (OSError, ValueError or KeyError when unreadable)."""
    return int(json.loads((Path(folder).expanduser() / "adapter_config.json").read_text())["r"])


def lora_kwargs(adapters: list[str]) -> dict:
    """Engine arguments to serve `adapters` (peft folders) beside the base model.

    One slot more than adapters: in a batch that mixes requests with and without an adapter, vLLM
    0.32's CPU LoRA ops give the base requests the adapter in the last slot (index -1; upstream
    vllm-project/vllm#48421, #49656). With that slot never filled, base requests get no adapter
    (tests/engine/test_lora.py compares each request of a mixed batch with the same request alone)."""
    rank = next(r for r in LORA_RANKS if r >= max(adapter_rank(path) for path in adapters))
    return {
        "enable_lora": True,
        "max_loras": len(adapters) + 1,
        "max_lora_rank": rank,
        "max_cpu_loras": len(adapters) + 1,
    }


def adapter_problems(config, tiers: list[str] | None = None) -> list[str]:
    """What stops a tenant's adapter on one of `tiers` (default: all) from being served (a missing folder,
    an unservable rank, weights shaped for another base model), before any work; [] when all can run."""
    from pipeline.keys import adapter_digest

    problems = []
    for tenant, t in config.tenants.items():
        tier = t.adapter_tier or config.route.default_tier
        if t.adapter is None or (tiers is not None and tier not in tiers):
            continue
        at = f"tenants.{tenant}.adapter {t.adapter}"
        try:
            adapter_digest(t.adapter)
            folder, rank = Path(t.adapter).expanduser(), adapter_rank(t.adapter)
        except (OSError, ValueError, TypeError, KeyError) as e:
            problems.append(f"{at}: {e}")
            continue
        if rank > LORA_RANKS[-1]:
            problems.append(f"{at}: rank {rank} is above what vLLM serves ({LORA_RANKS[-1]})")
        wrong = shape_mismatch(folder, Path(config.tiers[tier].model).expanduser())
        if wrong:
            problems.append(f"{at}: {wrong}; it was trained on another base model than tier {tier}'s")
    return problems


def shape_mismatch(adapter: Path, model: Path) -> str | None:
    """A LoRA matrix whose shape the tier's model has no place for (None: it fits, or it cannot be told:
    module names other than the Llama-style projections are not checked)."""
    weights, config = adapter / "adapter_model.safetensors", model / "config.json"
    if not weights.exists() or not config.exists():
        return None
    with open(weights, "rb") as f:  # the safetensors header: 8-byte length, then JSON (no torch needed)
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    c = json.loads(config.read_text())
    heads = c.get("num_attention_heads", 1)
    head_dim = c.get("head_dim") or c.get("hidden_size", 0) // max(heads, 1)
    hidden, inner, kv = c.get("hidden_size"), c.get("intermediate_size"), c.get("num_key_value_heads", heads) * head_dim
    # (input width, output width) of each projection
    shapes = {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inner),
        "up_proj": (hidden, inner),
        "down_proj": (inner, hidden),
    }
    for name, meta in header.items():
        module = next((m for m in shapes if f".{m}.lora_" in name), None)
        if module is None:
            continue
        want_in, want_out = shapes[module]
        got = meta["shape"][1] if name.endswith("lora_A.weight") else meta["shape"][0]
        want = want_in if name.endswith("lora_A.weight") else want_out
        if want and got != want:
            return f"{name} is {got} wide where the model's {module} is {want}"
    return None


def lora_requests(adapters: list[str]) -> dict:
    """One vLLM LoRARequest per adapter folder, named by its content digest: vLLM loads an adapter once per
    name, so a retrained adapter must not reuse the name of the weights it replaces."""
    from vllm.lora.request import LoRARequest

    from pipeline.keys import adapter_digest

    return {
        path: LoRARequest(adapter_digest(path), i, str(Path(path).expanduser()))
        for i, path in enumerate(adapters, start=1)
    }
