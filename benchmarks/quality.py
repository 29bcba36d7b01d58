"""Quality next to cost: `tokenmill eval` on the hold-out set of real text, as one JSON line.

Tiers: configs/local.yaml's two (small = SmolLM2 W4A16 INT4, large = float32, the baseline) plus
an INT8 tier (W8A8, priced between them), so both quantisation levers are measured against float32.
Prints the eval's tables, then one JSON line: per tier ROUGE-L agreement, identical share,
unfaithful rate, each output check's rate (degenerate, copied, off topic) and the share acceptable with
95% intervals, cost per 1,000 documents and per 1,000 acceptable summaries; the sampling knobs against
loops (configs/local.yaml's) against none on the small tier; the cheapest policy that keeps the target quality and
its share kept on the small tier; near and semantic reuse's false-hit rate with its 95% interval;
and whether each of the quality targets (RESULTS §6c) is met.

    python benchmarks/quality.py [--documents 300] [--variants 500] [--target 0.95]
    python benchmarks/quality.py --judge-only   # the checks against the labelled set only: no engine

First, always: the output checks against the labelled set (tests/data/judge/labels.jsonl, docs/judge-rubric.md):
thresholds chosen on its calibration half (`tokenmill checks calibrate`), each check's precision and recall on
its test half with 95% intervals, overall and per model (tier), against the targets.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml  # noqa: E402

from benchmarks.common import emit  # noqa: E402
from pipeline.cli.common import console  # noqa: E402
from pipeline.cli.evals import checks_table, knobs_table, policy_table, reuse_table, tiers_table  # noqa: E402
from pipeline.config import load_config, tokenmill_home  # noqa: E402
from pipeline.dev.holdout import build_holdout  # noqa: E402
from pipeline.evals.evaluate import run_eval  # noqa: E402
from pipeline.generate.engine import shutdown_engines  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def bench_config(folder: Path):
    """configs/local.yaml with an INT8 tier added (the file is the user's; this writes a copy)."""
    raw = yaml.safe_load((REPO / "configs" / "local.yaml").read_text())
    # A deep copy: a section shared with the large tier would be written as a YAML alias, which configs refuse.
    int8 = {
        **copy.deepcopy(raw["tiers"]["large"]),
        "model": "${TOKENMILL_HOME}/models/real/smollm2-w8a8",
        "price_per_gpu_hour": 1.0,
    }
    raw["tiers"] = {"small": raw["tiers"]["small"], "int8": int8, "large": raw["tiers"]["large"]}
    path = folder / "quality.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return load_config(path, environ={k: v for k, v in os.environ.items() if k == "TOKENMILL_HOME"})


LABELS = REPO / "tests" / "data" / "judge" / "labels.jsonl"


def escalation_by_labels(rows: list[dict], checks, small: str, large: str) -> dict | None:
    """Reader-kept shares on the documents both runs summarised: all on `small`, all on `large`, and `small`
    first with what its calibrated checks do not call acceptable generated again on `large` (the demo's
    escalation policy), with the share escalated. Every document of the labelled set, both halves: no
    threshold is chosen here."""
    from pipeline.evals.calibrate import KEPT, scored

    by_doc: dict[str, dict] = {}
    for r in rows:
        by_doc.setdefault(r["document_id"], {})[r["run"]] = r
    pairs = [(d[small], d[large]) for d in by_doc.values() if small in d and large in d]
    if not pairs:
        return None
    ok = [bool(scored(s["document"], s["summary"], s["finish_reason"], checks)["acceptable"]) for s, _ in pairs]
    served = [s if keep else big for (s, big), keep in zip(pairs, ok)]

    def kept(items: list[dict]) -> float:
        return round(sum(i["verdict"] in KEPT for i in items) / len(items), 4)

    return {
        "documents": len(pairs),
        "kept_all_small": kept([s for s, _ in pairs]),
        "kept_all_large": kept([b for _, b in pairs]),
        "kept_small_then_escalate": kept(served),
        "escalated_share": round(1 - sum(ok) / len(ok), 4),
    }


def judge_section(config, target_precision: float = 0.9) -> dict:
    """The checks against the labelled set: thresholds from its calibration half, figures on its test half
    (all, and per model), and the two quality targets (RESULTS §6c) on the test half."""
    from pipeline.cli.checks import agreement_table
    from pipeline.evals.calibrate import calibrate, half, read_labels, report

    rows = read_labels(LABELS)
    result = calibrate(rows, config.checks, target_precision)
    tuned = config.checks.model_copy(update=result["thresholds"])
    test = [r for r in rows if half(r) == "test"]
    model = {id(r): str(r.get("model") or r.get("run")) for r in test}  # crafted cases: no model, their run's name
    by_model = {m: report([r for r in test if model[id(r)] == m], tuned) for m in sorted(set(model.values()))}
    after = result["after"]["test"]
    console.print(
        agreement_table("output checks on the labelled test half (thresholds from the calibration half)", after)
    )
    for model, figures in by_model.items():
        console.print(agreement_table(f"test half, {model}", figures))
    acceptable, degenerate = after["acceptable"], after["degenerate"]
    return {
        "labels": str(LABELS.relative_to(REPO)),
        "items": result["items"],
        "labelled": result["labelled"],
        "verdicts": result["verdicts"],
        "thresholds": result["thresholds"],
        "test": after,
        "test_before": result["before"]["test"],
        "test_by_model": by_model,
        "escalation_by_labels": escalation_by_labels(rows, tuned, "small-configured", "large-configured"),
        "targets": {
            "acceptable_precision_ge_80pct_at_recall_ge_60pct": (acceptable["precision"]["rate"] or 0) >= 0.80
            and (acceptable["recall"]["rate"] or 0) >= 0.60,
            "repetition_recall_ge_90pct_at_precision_ge_90pct": (degenerate["recall"]["rate"] or 0) >= 0.90
            and (degenerate["precision"]["rate"] or 0) >= 0.90,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=300)
    parser.add_argument("--variants", type=int, default=500)  # ~200 reuses: enough to bound 2%
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--holdout", type=Path, default=None, help="An existing hold-out set (default: build one)")
    parser.add_argument("--judge-only", action="store_true", help="Only the checks against the labelled set")
    args = parser.parse_args()
    started = time.monotonic()
    local = load_config(
        REPO / "configs" / "local.yaml", environ={k: v for k, v in os.environ.items() if k == "TOKENMILL_HOME"}
    )
    judge = judge_section(local)
    if args.judge_only:
        emit("quality", {"judge": judge, "seconds": round(time.monotonic() - started, 1)})
        return
    with tempfile.TemporaryDirectory() as folder:
        holdout = args.holdout or Path(folder) / "holdout.jsonl"
        built = None if args.holdout else build_holdout(holdout, args.documents, args.variants)
        config = bench_config(Path(folder))
        try:
            result = run_eval(config, holdout, args.target)
        finally:
            shutdown_engines()
    routing, reuse = result["routing"], result["reuse"]
    console.print(tiers_table(result))
    console.print(checks_table(result))
    if result["loop_knobs"]:
        console.print(knobs_table(result["loop_knobs"]))
    console.print(policy_table("routing: router threshold alone", routing["by_router_threshold"], routing["chosen"]))
    console.print(
        policy_table("escalation: confidence threshold, no router", routing["by_logprob_threshold"], routing["chosen"])
    )
    console.print(
        policy_table(
            "chosen, all-small, all-large",
            [r for r in (routing["chosen"], routing["all_small"], routing["all_large"]) if r],
            routing["chosen"],
        )
    )
    console.print(reuse_table(reuse))
    routing.pop("router_artifact")
    chosen = routing["chosen"] or {}
    emit(
        "quality",
        {
            "holdout": result["holdout"],
            "holdout_sources": (built or {}).get("by_source"),
            "models": result["models"],
            "tiers": result["tiers"],
            "loop_knobs": result["loop_knobs"],
            "target_quality": args.target,
            "chosen": chosen,
            "all_small": routing["all_small"],
            "all_large": routing["all_large"],
            "router": {
                "train_documents": routing["train_documents"],
                "test_documents": routing["test_documents"],
                "note": routing["note"],
            },
            "reuse": {"by_kind": reuse["by_kind"], "total": reuse["total"], "labelled": reuse["labelled"]},
            "judge": judge,
            "targets": {
                "small_share_at_target_ge_40pct": bool(chosen) and chosen.get("small_share", 0) >= 0.40,
                "reuse_false_hit_upper95_le_2pct": reuse["total"]["ci95"][1] <= 0.02,
                "large_unfaithful_rate": result["tiers"][result["baseline_tier"]]["unfaithful_rate"],
            },
            "seconds": round(time.monotonic() - started, 1),
            "home": str(tokenmill_home()),
        },
    )


if __name__ == "__main__":
    main()
