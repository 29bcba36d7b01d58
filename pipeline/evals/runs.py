"""Every hold-out document generated on a tier, through the job's prompt and engine path, priced as the ledger
prices."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from pipeline.config import TokenmillConfig
from pipeline.generate.engine import EnginePool
from pipeline.generate.memory_units import generate
from pipeline.generate.quality import MEASURES, flags
from pipeline.generate.requests import build_requests

EVAL_TENANT = "eval"  # a name only: a run with no job serves no tenant's adapter (generate/memory_units.py)


@dataclass
class TierRun:
    """One tier's outputs for the documents asked, by id (documents that did not fit are missing)."""

    tier: str
    summary: dict[str, str]
    finish_reason: dict[str, str]
    mean_logprob: dict[str, float | None]
    output_tokens: dict[str, int]
    usd: dict[str, float]  # the ledger's price of each output: its token-weighted share of engine time
    measures: dict[str, dict]  # what the output checks read (quality.measure), as the job stores them
    engine_seconds: float
    failed: dict[str, str]  # id -> why no output (too long, engine error)

    def cost_per_1k(self, ids: list[str]) -> float:
        return 1000.0 * float(np.mean([self.usd[i] for i in ids])) if ids else 0.0

    def flags(self, i: str, checks) -> list[str]:
        """The checks output `i` fails, by name, as the job's ledger flags it (`checks`: config.checks):
        degenerate, copied, off_topic, unfaithful, truncated. None failed and not empty: acceptable."""
        item = {"summary": self.summary[i], "finish_reason": self.finish_reason[i], **self.measures[i]}
        return [name for name, raised in flags(item, checks).items() if raised and name != "empty"]

    def acceptable(self, i: str, flags: list[str]) -> bool:
        """Output `i` is one a user keeps: not empty, and `flags` (its flags()) empty."""
        return bool(self.summary[i].strip()) and not flags


def tier_run(docs: pa.Table, tier: str, config: TokenmillConfig, pool: EnginePool) -> TierRun:
    """Generate `docs` (columns id, text) on `tier`, one request per document, no reuse and no cache, through
    the tier worker as a job generates (generate/memory_units.py): the same engine loop, pricing and checks."""
    records = pa.table(
        {
            "id": docs["id"],
            "text": docs["text"],
            "tier": pa.array([tier] * docs.num_rows, pa.string()),
            "duplicate_of": pa.nulls(docs.num_rows, pa.string()),
        }
    )
    requests, too_long = build_requests(
        records,
        config.prompt,
        config.sampling,
        config.requests,
        {tier: pool.tokenizer(tier)},
        {tier: pool.context_length(tier)},
    )
    text = dict(zip(docs["id"].to_pylist(), docs["text"].to_pylist()))
    rows = [
        {
            "prompt_token_ids": r["prompt_token_ids"],
            "max_tokens": r["max_tokens"],
            "generation": {
                "item_key": r["id"],
                "id": r["id"],
                "tenant": EVAL_TENANT,
                "scope": "eval",
                "text": text[r["id"]],
            },
        }
        for r in requests.select(["id", "prompt_token_ids", "max_tokens"]).to_pylist()
    ]
    done, report = generate(rows, tier, config, pool, run_id=f"eval-{tier}")
    items = done.items
    price = config.tiers[tier].price_per_gpu_hour / 3600.0
    failed = dict(zip(too_long["id"].to_pylist(), too_long["detail"].to_pylist()))
    failed.update({key: f.detail for key, f in done.failed.items()})
    return TierRun(
        tier=tier,
        summary={i: r["summary"] for i, r in items.items()},
        finish_reason={i: r["finish_reason"] for i, r in items.items()},
        mean_logprob={i: r["mean_logprob"] for i, r in items.items()},
        output_tokens={i: r["output_tokens"] for i, r in items.items()},
        usd={i: r["gpu_seconds"] * price for i, r in items.items()},
        measures={i: {k: r[k] for k in ("unfaithful_terms", *MEASURES.values())} for i, r in items.items()},
        engine_seconds=report.busy_seconds,
        failed=failed,
    )
