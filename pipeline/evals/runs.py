"""Every hold-out document generated on a tier, through the job's prompt and engine path, priced as the ledger prices."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from pipeline.config import TokenmillConfig
from pipeline.generate.engine import EnginePool, run_inference
from pipeline.generate.pricing import allocate_gpu_seconds
from pipeline.generate.quality import failed_checks, measure
from pipeline.generate.requests import build_requests


@dataclass
class TierRun:
    """One tier's outputs for the documents asked, by id (documents that did not fit are missing)."""
    tier: str
    summary: dict[str, str]
    finish_reason: dict[str, str]
    mean_logprob: dict[str, float | None]
    output_tokens: dict[str, int]
    usd: dict[str, float]            # the ledger's price of each output: its token-weighted share of engine time
    measures: dict[str, dict]        # what the output checks read (quality.measure), as the job stores them
    engine_seconds: float
    failed: dict[str, str]           # id -> why no output (too long, engine error)

    def cost_per_1k(self, ids: list[str]) -> float:
        return 1000.0 * float(np.mean([self.usd[i] for i in ids])) if ids else 0.0

    def flags(self, i: str, checks) -> list[str]:
        """The checks output `i` fails, by name, as the job's ledger flags it (`checks`: config.checks):
        degenerate, copied, off_topic, unfaithful, truncated. None failed and not empty: acceptable."""
        item = {"summary": self.summary[i], **self.measures[i]}
        return [*failed_checks(item, checks), *(["unfaithful"] if self.measures[i].get("unfaithful_terms") else []),
                *(["truncated"] if self.finish_reason[i] == "length" else [])]

    def acceptable(self, i: str, flags: list[str]) -> bool:
        """Output `i` is one a user keeps: not empty, and `flags` (its flags()) empty."""
        return bool(self.summary[i].strip()) and not flags


def tier_run(docs: pa.Table, tier: str, config: TokenmillConfig, pool: EnginePool) -> TierRun:
    """Generate `docs` (columns id, text) on `tier`, one request per document, no reuse and no cache."""
    records = pa.table({"id": docs["id"], "text": docs["text"], "tier": pa.array([tier] * docs.num_rows, pa.string()),
                        "duplicate_of": pa.nulls(docs.num_rows, pa.string())})
    requests, too_long = build_requests(records, config.prompt, config.sampling, config.requests,
                                        {tier: pool.tokenizer(tier)}, {tier: pool.context_length(tier)})
    completions, calls, errors, _ = run_inference(requests, pool, config.sampling)
    gpu = allocate_gpu_seconds(completions, calls, config.tiers, config.cost)
    price = config.tiers[tier].price_per_gpu_hour / 3600.0
    text = dict(zip(docs["id"].to_pylist(), docs["text"].to_pylist()))
    rows = completions.to_pylist()
    failed = dict(zip(too_long["id"].to_pylist(), too_long["detail"].to_pylist()))
    failed.update(zip(errors["id"].to_pylist(), errors["detail"].to_pylist()))
    return TierRun(
        tier=tier,
        summary={r["id"]: r["summary"] for r in rows},
        finish_reason={r["id"]: r["finish_reason"] for r in rows},
        mean_logprob={r["id"]: r["mean_logprob"] for r in rows},
        output_tokens={r["id"]: r["output_tokens"] for r in rows},
        usd={r["id"]: float(g) * price for r, g in zip(rows, gpu)},
        measures={r["id"]: measure(r["summary"], text[r["id"]]) for r in rows},
        engine_seconds=float(sum(calls["seconds"].to_pylist())),
        failed=failed,
    )
