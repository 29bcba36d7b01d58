"""A synthetic labelled set for the learned router (pipeline/route/router.py): the label format, and
something to try `tokenmill router train` / `eval` on. It says nothing about any real model's quality."""

from __future__ import annotations

import json
import random
from pathlib import Path

from pipeline.dev.samples import synthetic_document


def example_labels(
    path: str | Path, items: int = 400, small: str = "small", large: str = "large", seed: int = 3
) -> Path:
    """A clearly SYNTHETIC labelled set: short plain documents suffice on the small tier, long number-dense
    ones need the large tier, with some noise. It shows the format and exercises train/eval; it says
    nothing about any real model's quality."""
    rng = random.Random(seed)
    lines = []
    for _ in range(items):
        hard = rng.random() < 0.4
        text = synthetic_document(rng, rng.randint(10, 24) if hard else rng.randint(2, 8))
        if hard:
            text += " " + " ".join(f"Figure {rng.randint(1, 99)}: {rng.randint(100, 99999)} units." for _ in range(6))
        q_large = round(rng.uniform(0.8, 1.0), 3)
        q_small = round(q_large * (rng.uniform(0.55, 0.85) if hard else rng.uniform(0.93, 1.0)), 3)
        if rng.random() < 0.08:  # label noise, as in any human-labelled set
            q_small = round(q_large * rng.uniform(0.5, 1.0), 3)
        lines.append(json.dumps({"text": text, "quality": {small: q_small, large: q_large}, "synthetic": True}))
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return Path(path)
