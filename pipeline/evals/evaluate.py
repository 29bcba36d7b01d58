"""`tokenmill eval`: run the hold-out set on every tier and score each saving against its cost."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import xxhash

from pipeline.config import TokenmillConfig
from pipeline.evals.policies import NO_LOGPROB, Policy, cheapest, grid, logprob_thresholds, score
from pipeline.evals.reuse import reuse_quality
from pipeline.evals.runs import TierRun, tier_run
from pipeline.generate.engine import EnginePool
from pipeline.generate.quality import rouge_l
from pipeline.generate.shadow import wilson_interval
from pipeline.job.stages import staged_input
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


def tier_section(run: TierRun, base: TierRun, ids: list[str], agreement: dict[str, float]) -> dict:
    done = [i for i in ids if i in run.summary and i in base.summary]
    unfaithful = sum(bool(run.unfaithful[i]) for i in done)
    low, high = wilson_interval(unfaithful, len(done))
    return {"documents": len(done), "failed": len(run.failed),
            "rouge_l_vs_baseline": round(float(np.mean([agreement[i] for i in done])), 4) if done else None,
            "identical_share": round(float(np.mean([run.summary[i] == base.summary[i] for i in done])), 4) if done else None,
            "unfaithful_rate": round(unfaithful / len(done), 4) if done else None, "unfaithful_ci95": [round(low, 4), round(high, 4)],
            "truncated_share": round(float(np.mean([run.finish_reason[i] == "length" for i in done])), 4) if done else None,
            "mean_output_tokens": round(float(np.mean([run.output_tokens[i] for i in done])), 1) if done else None,
            "cost_per_1k_usd": run.cost_per_1k(done), "engine_seconds": round(run.engine_seconds, 2)}


def split(ids: list[str]) -> tuple[list[str], list[str]]:
    """Train (router) and test (policies) halves, by a hash of the id: stable across runs and machines."""
    train = [i for i in ids if xxhash.xxh64_intdigest(i.encode()) % 2 == 0]
    return train, [i for i in ids if i not in set(train)]


def routing(config: TokenmillConfig, text: dict[str, str], ids: list[str], small: TierRun, large: TierRun,
            agreement: dict[str, float], target: float) -> dict:
    """Router trained on one half (labels from agreement), every policy scored on the other."""
    train, test = split(ids)
    artifact, note, curve = None, None, []
    try:
        artifact = train_router([text[i] for i in train], np.array([agreement[i] for i in train]),
                                np.ones(len(train)), small.tier, large.tier, target)
        router = Router(artifact)
        p = dict(zip(test, router.probabilities([text[i] for i in test]).tolist()))
        curve = calibration_curve(router, Labels([text[i] for i in test], np.array([agreement[i] for i in test]),
                                                 np.ones(len(test))), target)
    except RouterError as e:
        p, note = None, f"no router: {e}"
    thresholds = logprob_thresholds(small, test)
    rows = [score(policy, test, small, large, agreement, p, config) for policy in grid(p is not None, thresholds)]
    # Everything on the large tier: a router that sends every item there, whatever its probability.
    all_large = {**score(Policy(1.01, NO_LOGPROB, False, False), test, small, large, agreement, {i: 0.0 for i in test},
                         config), "router_threshold": None, "all_large": True}
    chosen = cheapest(rows + [all_large], target)  # when no mix is cheaper, all-large is the answer

    def plain(r: dict) -> bool:
        return r["min_mean_logprob"] == NO_LOGPROB and not r["on_truncation"] and not r["on_unfaithful"]

    by_router = [r for r in rows if plain(r) and r["router_threshold"] is not None]
    best_signals = chosen or {"on_truncation": True, "on_unfaithful": True}
    by_logprob = [r for r in rows if r["router_threshold"] is None and r["on_truncation"] == best_signals["on_truncation"]
                  and r["on_unfaithful"] == best_signals["on_unfaithful"]]
    all_small = next(r for r in rows if plain(r) and r["router_threshold"] is None)
    if artifact is not None and chosen is not None and chosen["router_threshold"] is not None:
        artifact.update(threshold=chosen["router_threshold"], calibrated_quality=chosen["quality_kept"],
                        calibrated_target=target, calibrated_on=len(test))
    return {"train_documents": len(train), "test_documents": len(test), "target_quality": target, "note": note,
            "all_large": all_large, "all_small": all_small, "by_router_threshold": by_router,
            "by_logprob_threshold": by_logprob, "signals_alone": signal_rows(rows), "chosen": chosen,
            "router_artifact": artifact, "calibration_curve": curve}


def signal_rows(rows: list[dict]) -> list[dict]:
    """Each escalation signal on its own, no router: what it costs and what it keeps."""
    def only(r, trunc, unf):
        return r["router_threshold"] is None and r["on_truncation"] == trunc and r["on_unfaithful"] == unf
    out = [next(r for r in rows if only(r, True, False) and r["min_mean_logprob"] == NO_LOGPROB),
           next(r for r in rows if only(r, False, True) and r["min_mean_logprob"] == NO_LOGPROB)]
    return out


def run_eval(config: TokenmillConfig, holdout: Path, target: float = 0.95, pool: EnginePool | None = None,
             shadows: int = 60) -> dict:
    """The eval (module docstring of pipeline/evals): a JSON-ready dict. `shadows`: reused variants also
    generated on their own, for the agreement figure (false hits need only the reused summary)."""
    if len(config.tiers) < 2:
        raise EvalError("the eval compares tiers: the config needs at least two")
    labels = read_labels(holdout)
    with tempfile.TemporaryDirectory() as folder:  # the reader lists folders: give it one holding only this file
        shutil.copyfile(holdout, Path(folder) / "holdout.jsonl")
        staged = staged_input(config, "eval", folder)
    records = staged.records
    ids = records["id"].to_pylist()
    text = dict(zip(ids, records["text"].to_pylist()))
    originals = [i for i in ids if "variant_of" not in labels.get(i, {})]
    by_price = sorted(config.tiers, key=lambda t: (config.tiers[t].price_per_gpu_hour * config.tiers[t].gpus, t))
    small, large = by_price[0], config.largest_tier
    pool = pool or EnginePool(config.tiers)
    docs = pa.table({"id": originals, "text": [text[i] for i in originals]})
    runs = {t: tier_run(docs, t, config, pool) for t in by_price if t != large}
    reused = [i for i, kind in zip(ids, records["reuse"].to_pylist()) if kind is not None and i not in set(originals)]
    on_large = originals + reused[:shadows]
    runs[large] = tier_run(pa.table({"id": on_large, "text": [text[i] for i in on_large]}), large, config, pool)
    base = runs[large]
    agreement = {t: {i: rouge_l(r.summary[i], base.summary[i]) for i in originals if i in r.summary and i in base.summary}
                 for t, r in runs.items()}
    scored = [i for i in originals if i in agreement[small]]
    return {
        "holdout": {"path": str(holdout), "records": staged.raw.num_rows, "quarantined": staged.quarantine.num_rows,
                    "documents": len(originals), "variants": len(ids) - len(originals),
                    "shadow_regenerated": min(len(reused), shadows)},
        "baseline_tier": large, "models": {t: config.tiers[t].model for t in by_price},
        "tiers": {t: tier_section(runs[t], base, originals, agreement[t]) for t in by_price},
        "routing": routing(config, text, scored, runs[small], base, agreement[small], target),
        "reuse": reuse_quality(records, labels, base),
        "labels": [{"text": text[i], "quality": {small: agreement[small][i], large: 1.0}} for i in scored],
    }
