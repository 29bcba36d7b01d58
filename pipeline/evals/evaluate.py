"""`tokenmill eval`: run the hold-out set on every tier and score each saving against its cost."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import xxhash

from pipeline.config import LOOP_KNOBS, TokenmillConfig
from pipeline.evals.policies import NO_LOGPROB, Outcomes, Policy, cheapest, grid, logprob_thresholds, rate, score
from pipeline.evals.reuse import reuse_quality
from pipeline.evals.runs import TierRun, tier_run
from pipeline.generate.engine import EnginePool
from pipeline.generate.quality import CHECKS, rouge_l
from pipeline.plan.stages import staged_input
from pipeline.route.router import Labels, Router, RouterError, calibration_curve, train_router


class EvalError(ValueError):
    """The hold-out set or the config cannot be evaluated; the message says why."""


def read_labels(path: Path) -> dict[str, dict]:
    """Per id, the hold-out line's labels (source, variant_of, variant, should_reuse)."""
    out = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise EvalError(f"hold-out set {path}: {e}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            out[str(row["id"])] = {k: row[k] for k in ("source", "variant_of", "variant", "should_reuse") if k in row}
        except (ValueError, KeyError, TypeError) as e:
            raise EvalError(f"{path}:{n}: expected a JSON object with `id` and `text`: {e}") from None
    return out


def tier_section(run: TierRun, base: TierRun, ids: list[str], agreement: dict[str, float], checks) -> dict:
    """One tier on the hold-out set against the baseline: agreement, each output check's rate, the share
    acceptable (no check failed) and what an acceptable summary costs."""
    done = [i for i in ids if i in run.summary and i in base.summary]
    flags = {i: run.flags(i, checks) for i in done}
    acceptable = sum(run.acceptable(i, flags[i]) for i in done)
    unfaithful = rate(sum("unfaithful" in flags[i] for i in done), len(done))
    spent = sum(run.usd[i] for i in done)
    return {
        "documents": len(done),
        "failed": len(run.failed),
        "rouge_l_vs_baseline": round(float(np.mean([agreement[i] for i in done])), 4) if done else None,
        "identical_share": round(float(np.mean([run.summary[i] == base.summary[i] for i in done])), 4)
        if done
        else None,
        "unfaithful_rate": unfaithful["rate"],
        "unfaithful_ci95": unfaithful["ci95"],
        "truncated_share": round(float(np.mean([run.finish_reason[i] == "length" for i in done])), 4) if done else None,
        "checks": {check: rate(sum(check in flags[i] for i in done), len(done)) for check in CHECKS},
        "acceptable": rate(acceptable, len(done)),
        "mean_output_tokens": round(float(np.mean([run.output_tokens[i] for i in done])), 1) if done else None,
        "cost_per_1k_usd": run.cost_per_1k(done),
        # what the tier spent on all, per acceptable summary: the price of one a user keeps
        "cost_per_1k_acceptable_usd": round(1000.0 * spent / acceptable, 6) if acceptable else None,
        "engine_seconds": round(run.engine_seconds, 2),
    }


def without_loop_knobs(config: TokenmillConfig, docs: pa.Table, tier: str, pool: EnginePool) -> TierRun | None:
    """The cheaper tier again with every sampling knob against loops (config.LOOP_KNOBS) neutral, on the
    same engine; None when no knob is set."""
    if not any(k in LOOP_KNOBS for k in config.sampling.keyed()):
        return None
    neutral = config.model_copy(update={"sampling": config.sampling.model_copy(update=LOOP_KNOBS)})
    return tier_run(docs, tier, neutral, pool)


def loop_knobs(
    config: TokenmillConfig, docs: pa.Table, small: TierRun, plain: TierRun | None, base: TierRun
) -> dict | None:
    """The sampling knobs against loops measured: the cheaper tier's run as configured next to its run with
    the knobs neutral (`plain`); the baseline keeps its knobs. None when no knob is set."""
    if plain is None:
        return None
    knobs = {k: v for k, v in config.sampling.keyed().items() if k in LOOP_KNOBS}

    def side(run: TierRun) -> dict:
        done = [i for i in docs["id"].to_pylist() if i in run.summary and i in base.summary]
        flags = {i: run.flags(i, config.checks) for i in done}
        return {
            "documents": len(done),
            "degenerate": rate(sum("degenerate" in flags[i] for i in done), len(done)),
            "acceptable": rate(sum(run.acceptable(i, flags[i]) for i in done), len(done)),
            "rouge_l_vs_baseline": round(float(np.mean([rouge_l(run.summary[i], base.summary[i]) for i in done])), 4)
            if done
            else None,
        }

    return {"tier": small.tier, "knobs": knobs, "with": side(small), "without": side(plain)}


def split(ids: list[str]) -> tuple[list[str], list[str]]:
    """Train (router) and test (policies) halves, by a hash of the id: stable across runs and machines."""
    even = [xxhash.xxh64_intdigest(i.encode()) % 2 == 0 for i in ids]
    return [i for i, e in zip(ids, even) if e], [i for i, e in zip(ids, even) if not e]


def routing(
    config: TokenmillConfig,
    text: dict[str, str],
    ids: list[str],
    small: TierRun,
    large: TierRun,
    outcomes: Outcomes,
    target: float,
    ruled: frozenset[str] = frozenset(),
) -> dict:
    """Router trained on one half (labels: each tier's output acceptable or not), every policy scored on the
    other."""
    train, test = split(ids)
    artifact, note, curve = None, None, []

    def labels(half: list[str]) -> Labels:
        return Labels(
            [text[i] for i in half],
            np.array([float(outcomes.small_ok[i]) for i in half]),
            np.array([float(outcomes.large_ok[i]) for i in half]),
        )

    try:
        fit = labels(train)
        artifact = train_router(fit.texts, fit.small_quality, fit.large_quality, small.tier, large.tier, target)
        router = Router(artifact)
        p = dict(zip(test, router.probabilities([text[i] for i in test]).tolist()))
        curve = calibration_curve(router, labels(test), target)
    except RouterError as e:
        p, note = None, f"no router: {e}"
    thresholds = logprob_thresholds(small, test)
    rows = [score(policy, test, small, large, outcomes, p, config, ruled) for policy in grid(p is not None, thresholds)]
    # Everything on the large tier: a router that sends every item there, whatever its probability.
    all_large = {
        **score(Policy(1.01, NO_LOGPROB, False, False), test, small, large, outcomes, {i: 0.0 for i in test}, config),
        "router_threshold": None,
        "all_large": True,
    }
    # When no mix is cheaper, all-large is the answer; and when all-large made no acceptable output, every policy
    # "keeps" its share of none: no evidence for a cheaper one, so all-large stays.
    chosen = cheapest(rows + [all_large], target) if all_large["acceptable"]["rate"] else all_large

    def plain(r: dict) -> bool:
        return r["min_mean_logprob"] == NO_LOGPROB and not r["on_truncation"] and not r["on_unfaithful"]

    by_router = [r for r in rows if plain(r) and r["router_threshold"] is not None]
    best_signals = chosen or {"on_truncation": True, "on_unfaithful": True}
    by_logprob = [
        r
        for r in rows
        if r["router_threshold"] is None
        and r["on_truncation"] == best_signals["on_truncation"]
        and r["on_unfaithful"] == best_signals["on_unfaithful"]
    ]
    all_small = next(r for r in rows if plain(r) and r["router_threshold"] is None)
    if artifact is not None and chosen is not None and chosen["router_threshold"] is not None:
        artifact.update(
            threshold=chosen["router_threshold"],
            calibrated_quality=chosen["quality_kept"],
            calibrated_target=target,
            calibrated_on=len(test),
        )
    return {
        "train_documents": len(train),
        "test_documents": len(test),
        "target_quality": target,
        "note": note,
        "all_large": all_large,
        "all_small": all_small,
        "by_router_threshold": by_router,
        "by_logprob_threshold": by_logprob,
        "signals_alone": signal_rows(rows),
        "chosen": chosen,
        "router_artifact": artifact,
        "calibration_curve": curve,
    }


def signal_rows(rows: list[dict]) -> list[dict]:
    """Each escalation signal on its own, no router: what it costs and what it keeps."""
    return [
        next(
            r
            for r in rows
            if r["router_threshold"] is None
            and r["min_mean_logprob"] == NO_LOGPROB
            and (r["on_truncation"], r["on_unfaithful"]) == signals
        )
        for signals in ((True, False), (False, True))
    ]


def run_eval(
    config: TokenmillConfig,
    holdout: Path,
    target: float = 0.95,
    pool: EnginePool | None = None,
    shadows: int = 60,
    min_documents: int = 20,
) -> dict:
    """The eval (module docstring of pipeline/evals): a JSON-ready dict. `shadows`: reused variants also
    generated on their own, for the agreement figure (false hits need only the reused summary)."""
    by_price = sorted(config.tiers, key=lambda t: (config.tiers[t].price_per_gpu_hour * config.tiers[t].gpus, t))
    small, large = by_price[0], config.largest_tier
    if len(config.tiers) < 2 or small == large or config.tier_prices[small] >= config.tier_prices[large]:
        raise EvalError(
            "the eval compares a cheaper tier with the largest one: the config needs two tiers of different price"
        )
    labels = read_labels(holdout)
    # Staged as the job stages, without the learned router: the eval scores routing itself (and may be
    # what retrains a router the config names but this version cannot read).
    staging = config.model_copy(update={"route": config.route.model_copy(update={"router": None})})
    with tempfile.TemporaryDirectory() as folder:  # the reader lists folders: give it one holding only this file
        shutil.copyfile(holdout, Path(folder) / "holdout.jsonl")
        staged = staged_input(staging, "eval", folder)
    records = staged.records
    ids = records["id"].to_pylist()
    text = dict(zip(ids, records["text"].to_pylist()))
    original = {i for i in ids if "variant_of" not in labels.get(i, {})}
    originals = [i for i in ids if i in original]
    if not originals:
        raise EvalError(f"{holdout}: no valid document to evaluate ({staged.quarantine.num_rows} quarantined)")
    test_half = len(split(originals)[1])
    if test_half < min_documents:  # before any engine starts
        raise EvalError(
            f"{test_half} of {len(originals)} documents fall in the test half: at least "
            f"{min_documents} are needed to choose a policy (the seeds' advice: 200-500 hold-out documents)"
        )
    ruled = frozenset(
        i
        for i, tier, reason in zip(ids, records["tier"].to_pylist(), records["route_reason"].to_pylist())
        if reason.startswith("rule:") and tier != small
    )
    pool = pool or EnginePool(config.tiers)
    docs = pa.table({"id": originals, "text": [text[i] for i in originals]})
    runs = {t: tier_run(docs, t, config, pool) for t in by_price if t != large}
    plain = without_loop_knobs(config, docs, small, pool)
    for t in runs:  # one engine at a time: a GPU that holds the largest tier may not hold a cheaper one beside it
        pool.shutdown(t)
    reused = [i for i, kind in zip(ids, records["reuse"].to_pylist()) if kind is not None and i not in original]
    on_large = originals + reused[:shadows]
    runs[large] = tier_run(pa.table({"id": on_large, "text": [text[i] for i in on_large]}), large, config, pool)
    base = runs[large]
    agreement = {
        t: {i: rouge_l(r.summary[i], base.summary[i]) for i in originals if i in r.summary and i in base.summary}
        for t, r in runs.items()
    }
    scored = [i for i in originals if i in agreement[small]]
    outcomes = Outcomes.of(runs[small], base, scored, agreement[small], config.checks)
    return {
        "holdout": {
            "path": str(holdout),
            "records": staged.raw.num_rows,
            "quarantined": staged.quarantine.num_rows,
            "documents": len(originals),
            "variants": len(ids) - len(originals),
            "shadow_regenerated": min(len(reused), shadows),
        },
        "baseline_tier": large,
        "models": {t: config.tiers[t].generator for t in by_price},
        "tiers": {t: tier_section(runs[t], base, originals, agreement[t], config.checks) for t in by_price},
        "loop_knobs": loop_knobs(config, docs, runs[small], plain, base),
        "routing": routing(config, text, scored, runs[small], base, outcomes, target, ruled),
        "reuse": reuse_quality(records, labels, base),
        # the router's labels (`tokenmill router train`): 1.0 where the tier's output is acceptable
        "labels": [
            {"text": text[i], "quality": {small: float(outcomes.small_ok[i]), large: float(outcomes.large_ok[i])}}
            for i in scored
        ],
    }
