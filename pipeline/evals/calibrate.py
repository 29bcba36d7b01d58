"""`tokenmill checks`: the output checks on a user's own outputs, and measured against a reader's labels.

`score` runs on a (document, summary, finish_reason) what the tier worker runs where an output meets its
document (quality.measure) and what the ledger flags (quality.flags): every measure, every flag and
`acceptable`. `calibrate` reads labelled lines (verdict good / borderline / bad, failure tags; the rubric is
docs/judge-rubric.md), splits them once by document into a calibration and a test half, chooses each
check's thresholds on the calibration half (the most recall at a target precision) and reports precision
and recall with 95% Wilson intervals on the test half, for each check and for `acceptable`.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path

import xxhash

from pipeline.config import ChecksConfig
from pipeline.generate.quality import (
    SUMMARY_MEASURES,
    acceptable,
    content_words,
    flags,
    measure,
    unsupported_share,
    unsupported_words,
)
from pipeline.generate.shadow import wilson_interval

VERDICTS = ("good", "borderline", "bad")
KEPT = ("good", "borderline")  # what `acceptable` should call acceptable
# The failure tags (docs/judge-rubric.md) each flag should raise on.
FLAG_TAGS = {
    "degenerate": {"repetition"},
    "copied": {"copied", "prompt_echo"},
    "off_topic": {"off_topic"},
    "unfaithful": {"unsupported"},
    "vague": {"vague"},
    "truncated": {"truncated"},
    "markup": {"markup"},
}
# The thresholds calibrated per check: (config field, measure, flagged when the measure is below/above it).
KNOBS = {
    "degenerate": (("degenerate_below", "compression_ratio", "below"), ("repetition_above", "repetition", "above")),
    "copied": (
        ("copied_above", "copied_share", "above"),
        ("prompt_echo_above", "prompt_echo", "above"),
        ("extract_min_words", "content_words", "below"),
    ),
    "off_topic": (("off_topic_below", "topic_overlap", "below"),),
    "unfaithful": (
        ("unsupported_above", "unsupported_words", "above"),
        ("unsupported_share_above", "unsupported_share", "above"),
    ),
    "vague": (("vague_below", "content_words", "below"),),
    "markup": (("markup_above", "markup_share", "above"),),
}
CANDIDATES = 24  # thresholds tried per knob: the measure's quantiles on the calibration half


class LabelsError(ValueError):
    """A labels or input file that cannot be read; the message names the line and what is wrong."""


def scored(document: str, summary: str, finish_reason: str, checks: ChecksConfig) -> dict:
    """One output as the tier worker measures it and the ledger flags it: every measure, flag and `acceptable`."""
    item = {"summary": summary, "finish_reason": finish_reason, **measure(summary, document)}
    every = flags(item, checks)
    measures = {k: v for k, v in item.items() if k not in ("summary", "finish_reason")}
    derived = {k: f(summary) for k, f in SUMMARY_MEASURES.items()}
    derived["unsupported_words"] = unsupported_words(summary, item["topic_overlap"])
    derived["unsupported_share"] = unsupported_share(summary, item["topic_overlap"])
    derived["content_words"] = content_words(summary, item["topic_overlap"])
    return {**measures, **derived, **every, "acceptable": acceptable(every)}


def read_lines(path: Path, required: tuple[str, ...]) -> list[dict]:
    """The JSON objects of a JSONL file, each with the `required` string fields."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise LabelsError(f"{path}: {e}") from None
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise LabelsError(f"{path}:{n}: not JSON: {e}") from None
        missing = [k for k in required if not isinstance(row, dict) or not isinstance(row.get(k), str)]
        if missing:
            raise LabelsError(f"{path}:{n}: expected a JSON object with string fields {', '.join(missing)}")
        if not isinstance(row.get("finish_reason", "stop"), str):
            raise LabelsError(f"{path}:{n}: finish_reason must be a string (stop, length)")
        rows.append(row)
    return rows


def read_labels(path: Path) -> list[dict]:
    rows = read_lines(path, ("document", "summary", "verdict"))
    for n, row in enumerate(rows, 1):
        if row.get("judge", False) not in (True, False, None):
            raise LabelsError(f"{path}: labelled item {n}: judge must be true, false or null (an LLM judge's verdict)")
        if row["verdict"] not in VERDICTS:
            raise LabelsError(f"{path}: labelled item {n}: verdict {row['verdict']!r} is not one of {VERDICTS}")
        if not isinstance(row.get("tags", []), list):
            raise LabelsError(f"{path}: labelled item {n}: tags must be a list of failure tags")
    return rows


def half(row: dict) -> str:
    """The item's half: its `split` when labelled so, else a hash of its document (all of one document's
    outputs in one half, so that no threshold is chosen on a document it is then tested on)."""
    if row.get("split") in ("calibration", "test"):
        return row["split"]
    key = str(row.get("document_id") or row["document"])
    return "calibration" if xxhash.xxh64_intdigest(key.encode()) % 2 == 0 else "test"


def agreement(raised: list[bool], truth: list[bool]) -> dict:
    """Precision and recall of `raised` against `truth`, each with its 95% Wilson interval."""
    tp = sum(r and t for r, t in zip(raised, truth))
    fp, fn = sum(raised) - tp, sum(truth) - tp

    def share(hits: int, n: int) -> dict:
        low, high = wilson_interval(hits, n)
        return {"rate": round(hits / n, 4) if n else None, "ci95": [round(low, 4), round(high, 4)], "n": n}

    return {"precision": share(tp, tp + fp), "recall": share(tp, tp + fn), "tp": tp, "fp": fp, "fn": fn}


def truth(row: dict, flag: str) -> bool:
    return (
        flag == "acceptable" and row["verdict"] in KEPT or bool(FLAG_TAGS.get(flag, set()) & set(row.get("tags", [])))
    )


def _candidates(values: list[float], side: str, current: float) -> list[float]:
    """Thresholds worth trying for one knob: just past each of CANDIDATES quantiles of its measure, and now's."""
    ordered = sorted({v for v in values if v is not None})
    picks = {ordered[round(i * (len(ordered) - 1) / (CANDIDATES - 1))] for i in range(CANDIDATES)} if ordered else set()
    below = side == "below"  # flags v < t: just past v flags v itself
    tried = {round(min(1.0, v + 1e-4), 4) if below else v for v in picks if isinstance(v, float)}
    tried |= {v + 1 if below else v for v in picks if isinstance(v, int)}
    tried |= {v for v in picks if below and isinstance(v, int)}  # the least flags none below it
    return sorted(tried, key=float) + ([current] if current not in tried else [])


def choose(
    check: str, rows: list[dict], scores: list[dict], checks: ChecksConfig, target: float
) -> tuple[dict[str, float], dict]:
    """The check's thresholds with the most recall at precision >= `target` on `rows` (ties: more precision,
    then the thresholds now); none reaching it: the most precise. Returns (thresholds, their agreement)."""
    knobs = tuple(k for k in KNOBS[check] if k[0] not in FOR_ACCEPTABLE)
    grids = [_candidates([s[m] for s in scores], side, getattr(checks, f)) for f, m, side in knobs]
    wanted = [truth(r, check) for r in rows]
    best, best_key = None, None
    for values in itertools.product(*grids):
        trial = checks.model_copy(update={f: v for (f, _, _), v in zip(knobs, values)})
        raised = [bool(flags({**s, "summary": r["summary"]}, trial)[check]) for r, s in zip(rows, scores)]
        a = agreement(raised, wanted)
        p, rec = a["precision"]["rate"] or 0.0, a["recall"]["rate"] or 0.0
        now = all(v == getattr(checks, f) for (f, _, _), v in zip(knobs, values))
        key = (p >= target, rec if p >= target else p, p, now)
        if best_key is None or key > best_key:
            best, best_key = ({f: v for (f, _, _), v in zip(knobs, values)}, a), key
    return best


# Thresholds whose checks' failure tags overlap the other failures (an invented word in a vague or looping output
# too), or that say when a flag is no reason to throw an output away (an extract of the document's key sentences
# is `copied` by its tag, yet kept): chosen for `acceptable` (its precision at a recall floor), not for their
# check's own precision.
FOR_ACCEPTABLE = ("unsupported_above", "unsupported_share_above", "vague_below", "extract_min_words")


def for_acceptable(rows: list[dict], scores: list[dict], checks: ChecksConfig, min_recall: float) -> dict[str, float]:
    """FOR_ACCEPTABLE's thresholds with the most `acceptable` precision at recall >= `min_recall` on `rows`
    (each knob in turn, twice over, the others held; ties: the thresholds now)."""
    items = [
        {**s, "summary": r["summary"], "finish_reason": r.get("finish_reason", "stop")} for r, s in zip(rows, scores)
    ]
    wanted = [truth(r, "acceptable") for r in rows]
    knobs = [k for c in KNOBS for k in KNOBS[c] if k[0] in FOR_ACCEPTABLE]
    chosen = {f: getattr(checks, f) for f, _, _ in knobs}
    for _ in range(2):
        for field, measure_name, side in knobs:
            best, best_key = chosen[field], None
            for value in _candidates([s[measure_name] for s in scores], side, chosen[field]):
                trial = checks.model_copy(update={**chosen, field: value})
                a = agreement([bool(acceptable(flags(i, trial))) for i in items], wanted)
                p, rec = a["precision"]["rate"] or 0.0, a["recall"]["rate"] or 0.0
                key = (rec >= min_recall, p if rec >= min_recall else rec, value == chosen[field])
                if best_key is None or key > best_key:
                    best, best_key = value, key
            chosen[field] = best
    return chosen


def report(rows: list[dict], checks: ChecksConfig) -> dict:
    """Each flag's and `acceptable`'s agreement with the labels of `rows`, under `checks`; and the failure tags
    of the items `acceptable` gets wrong (kept though bad; thrown away though good or borderline: its flags)."""
    scores = [scored(r["document"], r["summary"], r.get("finish_reason", "stop"), checks) for r in rows]
    out = {flag: agreement([bool(s[flag]) for s in scores], [truth(r, flag) for r in rows]) for flag in FLAG_TAGS}
    out["acceptable"] = agreement([bool(s["acceptable"]) for s in scores], [truth(r, "acceptable") for r in rows])
    kept_bad = Counter(t for r, s in zip(rows, scores) if s["acceptable"] and r["verdict"] == "bad" for t in r["tags"])
    lost = Counter(
        f for r, s in zip(rows, scores) if not s["acceptable"] and r["verdict"] in KEPT for f in FLAG_TAGS if s[f]
    )
    out["acceptable"]["bad_kept_by_tag"] = dict(kept_bad.most_common())
    out["acceptable"]["kept_lost_by_flag"] = dict(lost.most_common())
    if any("judge" in r for r in rows):  # an LLM judge's verdicts (llm_judge; true: keep), against `acceptable`'s truth
        out["judge"] = agreement([r.get("judge") is True for r in rows], [truth(r, "acceptable") for r in rows])
        out["judge"]["no_verdict"] = sum(r.get("judge") is None for r in rows)
    return out


def calibrate(
    rows: list[dict], checks: ChecksConfig, target_precision: float = 0.9, acceptable_recall: float = 0.6
) -> dict:
    """Thresholds chosen on the calibration half (each check's for the most recall at `target_precision`; those
    of FOR_ACCEPTABLE for `acceptable`'s precision at `acceptable_recall`), then every flag and `acceptable`
    reported on both halves (the test half's is the figure to quote: nothing was chosen on it)."""
    halves = {
        "calibration": [r for r in rows if half(r) == "calibration"],
        "test": [r for r in rows if half(r) == "test"],
    }
    cal = halves["calibration"]
    scores = [{**scored(r["document"], r["summary"], r.get("finish_reason", "stop"), checks)} for r in cal]
    chosen = {}
    for check in (c for c in KNOBS if any(k[0] not in FOR_ACCEPTABLE for k in KNOBS[c])):
        thresholds, _ = choose(check, cal, scores, checks, target_precision)
        chosen.update(thresholds)
    chosen.update(for_acceptable(cal, scores, checks.model_copy(update=chosen), acceptable_recall))
    tuned = checks.model_copy(update=chosen)
    return {
        "items": len(rows),
        "verdicts": dict(Counter(r["verdict"] for r in rows)),
        "documents": {k: len({str(r.get("document_id") or r["document"]) for r in v}) for k, v in halves.items()},
        "labelled": {k: len(v) for k, v in halves.items()},
        "target_precision": target_precision,
        "acceptable_recall": acceptable_recall,
        "thresholds": chosen,
        "before": {k: report(v, checks) for k, v in halves.items()},
        "after": {k: report(v, tuned) for k, v in halves.items()},
    }
