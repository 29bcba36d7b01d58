"""The learned router: which items the small tier summarises well enough, calibrated on the user's labels.

Features are cheap and need no model: lengths, sentence and word statistics, the density of digits,
capitals and punctuation (what makes a document hard to summarise faithfully). A logistic
regression over them (scikit-learn, on standardised features), calibrated by Platt's sigmoid on
cross-validated scores, gives p = P(the small tier suffices); items with p >= threshold go to the
small tier. The calibration is folded into the regression's weights, so the artifact is plain JSON
(never a pickle: artifacts are read from config paths) and routing needs numpy only, not sklearn.
`tokenmill router train` fits it on a labelled JSONL file, `tokenmill router eval` prints per
threshold the share sent to the large tier, the cost per item and the quality kept relative to
all-large, then the calibration curve (predicted p against the observed share), and writes the
cheapest threshold that keeps the target into the artifact.

Labels, one JSON object per line:
  {"text": "...", "tier": "small"}                             the cheapest tier whose summary suffices, or
  {"text": "...", "quality": {"small": 0.72, "large": 0.91}}   a quality score per tier (any scale, higher is better)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import xxhash

from pipeline.dedup.guards import NUMBER

FORMAT = 2  # 2: sklearn logistic regression with sigmoid calibration folded in
MAX_FOLDS = 5
FEATURES = [
    "log_chars",
    "log_words",
    "log_sentences",
    "mean_word_len",
    "mean_sentence_words",
    "digit_share",
    "upper_share",
    "punct_share",
    "log_numbers",
    "unique_word_share",
    "log_lines",
]


class RouterError(ValueError):
    """A labels file or artifact that cannot be used; the message says which line or field."""


def text_features(texts: list[str]) -> np.ndarray:
    rows = []
    for t in texts:
        words = t.split()
        n_chars, n_words = max(len(t), 1), max(len(words), 1)
        sentences = max(t.count(".") + t.count("!") + t.count("?"), 1)
        rows.append(
            [
                np.log1p(len(t)),
                np.log1p(len(words)),
                np.log1p(sentences),
                sum(len(w) for w in words) / n_words,
                len(words) / sentences,
                sum(c.isdigit() for c in t) / n_chars,
                sum(c.isupper() for c in t) / n_chars,
                sum(not c.isalnum() and not c.isspace() for c in t) / n_chars,
                np.log1p(len(NUMBER.findall(t))),
                len(set(w.lower() for w in words)) / n_words,
                np.log1p(t.count("\n")),
            ]
        )
    return np.asarray(rows, dtype=np.float64).reshape(len(texts), len(FEATURES))


@dataclass
class Labels:
    texts: list[str]
    small_quality: np.ndarray  # per item, quality of the small tier's output
    large_quality: np.ndarray

    def small_suffices(self, target: float) -> np.ndarray:
        return self.small_quality >= target * self.large_quality


def read_labels(path: str | Path, small: str, large: str) -> Labels:
    texts, qs, ql = [], [], []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise RouterError(f"labels {path}: {getattr(e, 'strerror', None) or e}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            text = row["text"]
            if "quality" in row:
                q = row["quality"]
                qs.append(float(q[small]))
                ql.append(float(q[large]))
                if not (math.isfinite(qs[-1]) and math.isfinite(ql[-1])):
                    # A score left out and written as NaN would train and calibrate on nothing, silently.
                    raise RouterError(
                        f"{path}:{n}: the quality scores must be finite numbers ({small}: {qs[-1]}, {large}: "
                        f"{ql[-1]}); label the item or leave it out"
                    )
            else:
                if row["tier"] not in (small, large):
                    raise RouterError(f"{path}:{n}: tier {row['tier']!r} is neither {small!r} nor {large!r}")
                qs.append(1.0 if row["tier"] == small else 0.0)
                ql.append(1.0)
        except RouterError:
            raise
        except (ValueError, KeyError, TypeError) as e:
            raise RouterError(
                f'{path}:{n}: expected {{"text", "tier"}} or {{"text", "quality": '
                f'{{"{small}", "{large}"}}}}: {type(e).__name__}: {e}'
            ) from None
        if not isinstance(text, str) or not text.strip():
            raise RouterError(f"{path}:{n}: `text` must be a non-empty string")
        texts.append(text)
    if len(texts) < 10:
        raise RouterError(f"{path}: {len(texts)} labelled items; at least 10 are needed (hundreds to calibrate well)")
    return Labels(texts, np.asarray(qs), np.asarray(ql))


class Router:
    """A trained router artifact: scales, weights, the tiers it chooses between, and its threshold."""

    def __init__(self, artifact: dict):
        # Format 1 (hand-written gradient descent) holds the same fields and routes with the same maths.
        if artifact.get("format") not in (1, FORMAT) or artifact.get("features") != FEATURES:
            raise RouterError(
                f"router artifact format {artifact.get('format')} / features do not match this "
                "tokenmill; train it again with `tokenmill router train`"
            )
        self.artifact = artifact
        self.mean, self.scale = np.asarray(artifact["mean"]), np.asarray(artifact["scale"])
        self.weights, self.bias = np.asarray(artifact["weights"]), float(artifact["bias"])
        self.small, self.large = artifact["small_tier"], artifact["large_tier"]
        self.threshold = float(artifact["threshold"])

    @staticmethod
    def load(path: str | Path) -> "Router":
        try:
            return Router(json.loads(Path(path).read_text()))
        except FileNotFoundError:
            raise RouterError(f"router artifact {path} not found (train one: tokenmill router train)") from None
        except (ValueError, KeyError) as e:
            raise RouterError(f"router artifact {path} is unreadable: {e}") from None

    def probabilities(self, texts: list[str]) -> np.ndarray:
        x = (text_features(texts) - self.mean) / self.scale
        return 1 / (1 + np.exp(-np.clip(x @ self.weights + self.bias, -500, 500)))

    def route(self, texts: list[str]) -> list[tuple[str, float]]:
        return [(self.small if p >= self.threshold else self.large, float(p)) for p in self.probabilities(texts)]


def calibrated_model(x: np.ndarray, y: np.ndarray):
    """A logistic regression on all of x, calibrated by a sigmoid fitted on out-of-fold scores
    (`ensemble=False`: one regression and one calibrator, so the two fold into one linear model).

    Folds: up to MAX_FOLDS, fewer when the rarer outcome has fewer items (each fold needs one)."""
    from sklearn.calibration import CalibratedClassifierCV
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedKFold

    folds = min(MAX_FOLDS, int(min(y.sum(), len(y) - y.sum())))
    cv = StratifiedKFold(n_splits=folds, shuffle=True, random_state=0)
    model = CalibratedClassifierCV(LogisticRegression(C=1.0, max_iter=1000), method="sigmoid", cv=cv, ensemble=False)
    return model.fit(x, y)


def fold_calibration(model) -> tuple[np.ndarray, float, dict]:
    """(weights, bias, calibration) of one logistic model equal to the calibrated one.

    The regression scores z = w·x + b; sklearn's sigmoid calibrator maps z to sigmoid(-(a·z + c)),
    which is sigmoid((-a·w)·x + (-a·b - c)): again logistic in x, exactly."""
    (pair,) = model.calibrated_classifiers_
    lr, (sig,) = pair.estimator, pair.calibrators
    w, b, a, c = lr.coef_[0], float(lr.intercept_[0]), float(sig.a_), float(sig.b_)
    calibration = {
        "method": "sigmoid",
        "folds": model.cv.n_splits,
        "a": a,
        "b": c,
        "logistic_weights": w.tolist(),
        "logistic_bias": b,
    }
    return -a * w, -a * b - c, calibration


def train_router(texts: list[str], small_quality, large_quality, small: str, large: str, target_quality: float) -> dict:
    """Fit and calibrate the router on items with a quality score per tier; returns the JSON artifact.

    An item's small tier suffices when small_quality >= target_quality * large_quality."""
    labels = Labels(
        list(texts), np.asarray(small_quality, dtype=np.float64), np.asarray(large_quality, dtype=np.float64)
    )
    if not len(labels.texts) == len(labels.small_quality) == len(labels.large_quality):
        raise RouterError(
            f"{len(labels.texts)} texts but {len(labels.small_quality)} small and "
            f"{len(labels.large_quality)} large quality scores"
        )
    y = labels.small_suffices(target_quality).astype(np.int64)
    fine, n = int(y.sum()), len(y)
    if min(fine, n - fine) < 2:
        raise RouterError(
            f"{n} labelled items, {fine} where {small} suffices at target quality {target_quality}: "
            f"the router needs at least 2 items of each outcome to learn and calibrate "
            f"(hundreds to calibrate well); label more items or change --target-quality"
        )
    x = text_features(labels.texts)
    mean, scale = x.mean(axis=0), x.std(axis=0) + 1e-9
    w, b, calibration = fold_calibration(calibrated_model((x - mean) / scale, y))
    artifact = {
        "format": FORMAT,
        "features": FEATURES,
        "mean": mean.tolist(),
        "scale": scale.tolist(),
        "weights": w.tolist(),
        "bias": b,
        "calibration": calibration,
        "small_tier": small,
        "large_tier": large,
        "threshold": 0.5,
        "target_quality": target_quality,
        "trained_on": n,
        "small_suffices_share": fine / n,
        "trained_at": datetime.now(timezone.utc).isoformat(),
    }
    artifact["version"] = xxhash.xxh64_hexdigest(json.dumps([w.tolist(), b, mean.tolist(), scale.tolist()]).encode())
    return artifact


def train(labels: Labels, small: str, large: str, target_quality: float) -> dict:
    return train_router(labels.texts, labels.small_quality, labels.large_quality, small, large, target_quality)


def evaluate(
    router: Router, labels: Labels, cost_small: float, cost_large: float, thresholds: np.ndarray | None = None
) -> list[dict]:
    """Per threshold: share to the large tier, cost per item, quality kept relative to all-large."""
    p = router.probabilities(labels.texts)
    all_large = float(labels.large_quality.sum()) or 1.0
    rows = []
    for t in np.round(np.arange(0.0, 1.0001, 0.05), 2) if thresholds is None else thresholds:
        small = p >= t
        quality = float(np.where(small, labels.small_quality, labels.large_quality).sum()) / all_large
        rows.append(
            {
                "threshold": float(t),
                "large_share": round(float(1 - small.mean()), 4),
                "cost_per_item_usd": float(small.mean() * cost_small + (1 - small.mean()) * cost_large),
                "quality_kept": round(quality, 4),
            }
        )
    return rows


def pick_threshold(rows: list[dict], target_quality: float) -> dict | None:
    """The cheapest threshold whose quality kept meets the target (None: only all-large does)."""
    ok = [r for r in rows if r["quality_kept"] >= target_quality]
    return min(ok, key=lambda r: (r["cost_per_item_usd"], -r["threshold"])) if ok else None


def calibration_curve(router: Router, labels: Labels, target_quality: float, bins: int = 10) -> list[dict]:
    """Per probability bin with items: the mean predicted p against the observed share where the small
    tier suffices (a calibrated router has the two close), and the item count. Empty bins are left out."""
    p = router.probabilities(labels.texts)
    observed = labels.small_suffices(target_quality)
    which = np.minimum((p * bins).astype(int), bins - 1)
    rows = []
    for k in range(bins):
        inside = which == k
        if inside.any():
            rows.append(
                {
                    "low": round(k / bins, 4),
                    "high": round((k + 1) / bins, 4),
                    "mean_predicted": round(float(p[inside].mean()), 4),
                    "observed": round(float(observed[inside].mean()), 4),
                    "count": int(inside.sum()),
                }
            )
    return rows
