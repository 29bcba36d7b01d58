"""Routing and escalation policies scored offline from every document's output on both tiers.

Each document was generated on the small and on the large tier once, so any policy (a router
threshold, escalation signals and a confidence threshold) is scored without generating again: the
served output is the small tier's unless the router sends the document to the large tier or an
escalation signal fires (the job's own `escalation_reason` decides, with the policy's settings),
and the cost is what the ledger would carry: small, large, or both for an escalated item.
Quality is the share of served outputs that are acceptable (no output check failed: the checks
calibrated against a reader's labels, tests/data/judge/labels.jsonl), with its 95% Wilson interval;
quality kept is that share relative to all-large's (all-large keeps 1.0 by definition). ROUGE-L
agreement with the large tier's wording (1.0 where large served) is reported beside it, never chosen by:
a quantised copy of the large model words its summaries differently where a reader keeps them alike.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from pipeline.config import TokenmillConfig
from pipeline.evals.runs import TierRun
from pipeline.generate.followup import escalation_reason
from pipeline.generate.shadow import wilson_interval

NO_LOGPROB = None  # min_mean_logprob: the confidence signal off


def rate(hits: int, n: int) -> dict:
    """A share of `n` with its 95% Wilson interval (null when nothing was measured)."""
    low, high = wilson_interval(hits, n)
    return {"rate": round(hits / n, 4) if n else None, "ci95": [round(low, 4), round(high, 4)]}


@dataclass(frozen=True)
class Outcomes:
    """Per document, what each tier's output is worth: acceptable (TierRun.acceptable with the config's
    checks) on each tier, and the small output's ROUGE-L agreement with the large one's (the secondary figure)."""

    small_ok: dict[str, bool]
    large_ok: dict[str, bool]
    agreement: dict[str, float]

    @classmethod
    def of(cls, small: TierRun, large: TierRun, ids: list[str], agreement: dict[str, float], checks) -> Outcomes:
        return cls(
            {i: small.acceptable(i, small.flags(i, checks)) for i in ids},
            {i: large.acceptable(i, large.flags(i, checks)) for i in ids},
            {i: agreement[i] for i in ids},
        )


@dataclass(frozen=True)
class Policy:
    router_threshold: float | None  # router p below it: straight to the large tier; None: no router
    min_mean_logprob: float | None  # NO_LOGPROB (None): the confidence signal is off
    on_truncation: bool
    on_unfaithful: bool


def escalation_config(config: TokenmillConfig, policy: Policy, large: str) -> TokenmillConfig:
    escalation = config.route.escalation.model_copy(
        update={
            "enabled": True,
            "to_tier": large,
            "min_mean_logprob": policy.min_mean_logprob,
            "on_truncation": policy.on_truncation,
            "on_unfaithful": policy.on_unfaithful,
        }
    )
    return config.model_copy(update={"route": config.route.model_copy(update={"escalation": escalation})})


def score(
    policy: Policy,
    ids: list[str],
    small: TierRun,
    large: TierRun,
    outcomes: Outcomes,
    router_p: dict[str, float] | None,
    config: TokenmillConfig,
    ruled: frozenset[str] = frozenset(),
) -> dict:
    """Acceptable share (95% interval), quality kept against all-large, ROUGE-L kept, shares and cost per
    1,000 documents of one policy over `ids`. `ruled`: ids a route rule sends past the small tier (as in the
    job, rules decide before the router and escalation). quality_kept_ci95 is the acceptable share's
    interval over all-large's share, taken as exact."""
    cfg = escalation_config(config, policy, large.tier)
    served_ok, agreement, cost, kept_small, escalated, reasons = 0, [], [], 0, 0, {}
    for i in ids:
        if i in ruled or (
            policy.router_threshold is not None and router_p is not None and router_p[i] < policy.router_threshold
        ):
            served_ok += outcomes.large_ok[i]
            agreement.append(1.0)
            cost.append(large.usd[i])
            continue
        item = {
            "tier": small.tier,
            "summary": small.summary[i],
            "finish_reason": small.finish_reason[i],
            "mean_logprob": small.mean_logprob[i],
            "chunks": 0,
            **small.measures[i],
        }
        reason = escalation_reason(item, cfg)
        if reason is None:
            kept_small += 1
            served_ok += outcomes.small_ok[i]
            agreement.append(outcomes.agreement[i])
            cost.append(small.usd[i])
        else:
            escalated += 1
            reasons[reason] = reasons.get(reason, 0) + 1
            served_ok += outcomes.large_ok[i]
            agreement.append(1.0)
            cost.append(small.usd[i] + large.usd[i])
    n = max(len(ids), 1)
    acceptable = rate(served_ok, len(ids))
    base = sum(outcomes.large_ok[i] for i in ids)  # all-large's acceptable outputs

    # 1.0 where large made none acceptable: no evidence either way, and evaluate.py then keeps all-large.
    def kept(hits: float) -> float:
        return round(hits / base, 4) if base else 1.0

    return {
        **asdict(policy),
        "quality_kept": kept(served_ok),
        "quality_kept_ci95": [kept(b * len(ids)) for b in acceptable["ci95"]],
        "acceptable": acceptable,
        "rouge_l_kept": round(float(np.mean(agreement)) if agreement else 0.0, 4),
        "small_share": round(kept_small / n, 4),
        "escalated_share": round(escalated / n, 4),
        "escalated_by": reasons,
        "cost_per_1k_usd": 1000.0 * float(np.mean(cost)) if cost else 0.0,
    }


def logprob_thresholds(small: TierRun, ids: list[str]) -> list[float]:
    """The confidence signal off, then thresholds at the 5th … 60th percentile of the small tier's outputs."""
    values = [small.mean_logprob[i] for i in ids if small.mean_logprob[i] is not None]
    qs = sorted({round(float(np.percentile(values, q)), 3) for q in range(5, 61, 5)}) if values else []
    return [NO_LOGPROB, *qs]


def grid(has_router: bool, thresholds: list[float]) -> list[Policy]:
    routers = [None, *[round(t, 2) for t in np.arange(0.05, 1.0, 0.05)]] if has_router else [None]
    return [
        Policy(r, m, trunc, unf)
        for r in routers
        for m in thresholds
        for trunc in (False, True)
        for unf in (False, True)
    ]


def cheapest(rows: list[dict], target: float) -> dict | None:
    """The cheapest row keeping `target` of all-large's acceptable share (ties: more kept on the small tier)."""
    ok = [r for r in rows if r["quality_kept"] >= target]
    return min(ok, key=lambda r: (round(r["cost_per_1k_usd"], 12), -r["small_share"])) if ok else None
