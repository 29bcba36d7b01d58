"""LoRA adapters: one per tenant, served beside the base model in the tier's engine (config `tenants`).

An adapter is a peft folder (adapter_config.json + weights); its content digest (keys.adapter_digest)
is part of the item key of every request made with it.
"""

from __future__ import annotations

import json
from pathlib import Path

# vLLM's allowed LoRA ranks (vllm/config/lora.py MaxLoRARanks).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_kwargs(adapters: list[str]) -> dict:
    """Engine arguments to serve `adapters` (peft folders) beside the base model.

    One slot more than adapters: in a batch that mixes requests with and without an adapter, vLLM
    0.32's CPU LoRA ops give the base requests the adapter in the last slot (index -1; upstream
    vllm-project/vllm#48421, #49656). With that slot never filled, base requests get no adapter
    (tests/test_adapters.py compares each request of a mixed batch with the same request alone)."""
    ranks = []
    for path in adapters:
        config = json.loads((Path(path).expanduser() / "adapter_config.json").read_text())
        ranks.append(int(config.get("r", 8)))
    rank = next(r for r in LORA_RANKS if r >= max(ranks))
    return {"enable_lora": True, "max_loras": len(adapters) + 1, "max_lora_rank": rank,
            "max_cpu_loras": len(adapters) + 1}
