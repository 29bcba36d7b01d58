"""Money: share each engine call's GPU-seconds among its items, and price them.

vLLM batches continuously, so no item has its own wall time. An engine call's wall seconds × the
tier's GPUs are shared among the items it completed by token weight (uncached prompt tokens,
cached prompt tokens and output tokens each weighted by config), so the ledger's GPU-seconds add
up exactly to what the engines ran. cost_usd = gpu_seconds × price_per_gpu_hour / 3600.

The baseline is what an item would have cost with no dedup and no cache (prefix cache included),
on the largest tier, at the GPU-seconds per token weight that tier achieved in the same engine call
(or the item's own tier's rate when the call ran on another tier).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from pipeline.config import CostConfig


def token_weight(prompt, cached, output, cost: CostConfig) -> np.ndarray:
    prompt, cached, output = (np.asarray(x, dtype=np.float64) for x in (prompt, cached, output))
    return (
        cost.prefill_token_weight * (prompt - cached)
        + cost.cached_token_weight * cached
        + cost.decode_token_weight * output
    )


def baseline_gpu_seconds(
    completions: pa.Table, gpu_seconds: np.ndarray, largest_tier: str, cost: CostConfig
) -> np.ndarray:
    """GPU-seconds each completion would have taken on the largest tier with no prefix cache."""
    actual_w = token_weight(
        completions["prompt_tokens"], completions["cached_prompt_tokens"], completions["output_tokens"], cost
    )
    uncached_w = token_weight(
        completions["prompt_tokens"], np.zeros(completions.num_rows), completions["output_tokens"], cost
    )
    tier = np.asarray(completions["tier"].to_pylist(), dtype=object)
    rates = {}
    for name in set(tier.tolist()):
        rows = tier == name
        rates[name] = gpu_seconds[rows].sum() / actual_w[rows].sum() if actual_w[rows].sum() > 0 else 0.0
    rate = np.array([rates.get(largest_tier, rates[t]) for t in tier], dtype=np.float64) if len(tier) else np.zeros(0)
    return uncached_w * rate


@dataclass(frozen=True)
class SessionShare:
    """How one engine session's held GPU-seconds land in the ledger: its items' and charges' busy
    seconds × (1 + overhead_ratio), plus `lost` (busy time of requests that died with their worker)."""

    held: float  # held seconds × GPUs
    overhead_ratio: float  # start-up and idle GPU-seconds per busy GPU-second recorded
    lost: float  # GPU-seconds of work lost with a dead worker (its last renewal's figures)


# Busy seconds measured minus those recorded, below which nothing was lost: the recorded figure is a sum of
# shared float intervals, so a session that stored everything can differ from its busy time by ~1e-16.
LOST_EPSILON_SECONDS = 1e-6


def session_shares(
    sessions: list, recorded: dict[str, float], stale: Callable[[object], bool]
) -> dict[str, SessionShare]:
    """Per session: start-up and idle shared among what it recorded, pro rata to busy share (the way
    OpenCost shares a node's idle cost among its workloads). A session that stopped renewing without
    closing (`stale`: its worker died) also has lost work: busy seconds it measured but never
    recorded. A session that recorded nothing puts all it held into `lost`."""
    out = {}
    for s in sessions:
        held = (s.startup_seconds + s.busy_seconds + s.idle_seconds) * s.gpus
        done = recorded.get(s.session_id, 0.0)
        unstored = s.busy_seconds - s.recorded_seconds
        lost = unstored * s.gpus if stale(s) and unstored > LOST_EPSILON_SECONDS else 0.0
        if done <= 0:
            out[s.session_id] = SessionShare(held, 0.0, held)
        else:
            out[s.session_id] = SessionShare(held, max(held - done - lost, 0.0) / done, lost)
    return out
