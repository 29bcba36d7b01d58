"""The nightly delta against the peer: the second night of a nightly job, in which most documents did not change.

Night 1 summarises N documents (no duplicates); night 2 gets the same set with 10% of the documents edited (one
sentence replaced), 5% new and 5% removed. Each night is one OpenAI batch file (`custom_id` = the document id),
run through vLLM's own batch runner (`python -m vllm.entrypoints.openai.run_batch`, which keeps nothing between
runs) and through tokenmill (its catalog and cache kept from night 1 to night 2, as a deployment keeps them), on
the same model, prompt and sampling, one after the other in one run. Printed per night and system: wall seconds,
engine-seconds (the peer's are its wall seconds: it holds the engine all along; tokenmill's are its manifest's
held seconds), documents answered, and tokenmill's engine-seconds over the peer's.
Targets: night 2 at most 0.25x the peer's engine-seconds, night 1 at most 1.05x.

Usage: python benchmarks/nightly_delta.py [DOCUMENTS (200)] [--tiny] [--max-tokens N (64)]
(default: configs/local.yaml's large tier, SmolLM2-135M float32 from `tokenmill models real`; --tiny:
configs/tiny.yaml's small tier, random weights, for a quick check of the harness)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.batch_api import model_tier, peer, request, scratch, tokenmill  # noqa: E402
from benchmarks.common import emit  # noqa: E402


def nights(n: int, rng: random.Random) -> tuple[dict[str, str], dict[str, str], dict[str, int]]:
    """(night 1's documents by id, night 2's, what changed): 10% edited, 5% new, 5% removed."""
    from pipeline.dev.samples import synthetic_document

    first = {f"d{i}": synthetic_document(rng, 10) for i in range(n)}
    ids = sorted(first)
    rng.shuffle(ids)
    removed, edited = ids[: n // 20], ids[n // 20 : n // 20 + n // 10]
    second = {k: v for k, v in first.items() if k not in removed}
    for k in edited:  # one sentence replaced by a new one: a real edit, not a near copy
        sentences = second[k].split(". ")
        sentences[rng.randrange(len(sentences))] = synthetic_document(rng, 1).rstrip(".")
        second[k] = ". ".join(sentences)
    second |= {f"n{i}": synthetic_document(rng, 10) for i in range(n // 20)}
    return first, second, {"edited": len(edited), "new": n // 20, "removed": len(removed)}


def write_night(folder: Path, docs: dict[str, str], max_tokens: int) -> Path:
    folder.mkdir(parents=True)
    path = folder / "night.jsonl"
    path.write_text("".join(json.dumps(request(i, text, max_tokens)) + "\n" for i, text in docs.items()))
    return path


if __name__ == "__main__":
    args = argparse.ArgumentParser()
    args.add_argument("documents", type=int, nargs="?", default=200)
    args.add_argument("--tiny", action="store_true", help="configs/tiny.yaml's small tier (random weights)")
    args.add_argument("--max-tokens", type=int, default=64)
    a = args.parse_args()
    config_path, tier_name, tier = model_tier(not a.tiny)
    with scratch() as tmp:
        work = Path(tmp)
        first, second, changed = nights(a.documents, random.Random(30))
        figures: dict = {"documents": a.documents, "night_2_changes": changed}
        for night, docs in (("night_1", first), ("night_2", second)):
            path = write_night(work / night, docs, a.max_tokens)
            theirs = peer(path, work / f"{night}-peer.jsonl", tier)
            # one tokenmill deployment for both nights: its catalog, cache and output root under work/tokenmill
            ours = tokenmill(path.parent, work, "tokenmill", config_path, tier_name, a.max_tokens, job_id=night)
            figures[night] = {
                "documents": len(docs),
                "peer (vllm run_batch)": theirs,
                "tokenmill": ours,
                "engine_seconds_ratio": round(ours["engine_seconds"] / theirs["engine_seconds"], 3),
                "target_ratio": 0.25 if night == "night_2" else 1.05,
            }
        emit("nightly_delta", {"model": tier.model.rsplit("/", 1)[-1], "max_tokens": a.max_tokens, **figures})
