"""Batch API: one OpenAI batch file through vLLM's own batch runner (`python -m vllm.entrypoints.openai.run_batch`,
the peer) and through tokenmill, on the same model, prompt and sampling, one after the other.

Two files: REQUESTS chat requests of which about 30% are exact or near duplicates of others (one word
changed) and two are longer than the model's context; and REQUESTS distinct requests with
no duplicate. The peer holds its engine for its whole run, so its engine-seconds are its wall seconds;
tokenmill's are what its manifest says its engines were held (start-up, busy and idle). Printed per file:
wall seconds, engine-seconds, requests answered, errors, and tokenmill's engine-seconds over the peer's.
Targets: every request answered by tokenmill; at most 0.75x the peer's engine-seconds on the first file
and at most 1.1x on the second. Semantic reuse's shadow sample is off (`dedup.shadow_rate: 0`) and so is
escalation, so that both do the same work per request. The model: configs/tiny.yaml's small tier (random
weights: every answer runs to max_tokens, the same on both sides); with `--real`, configs/local.yaml's large
tier, SmolLM2-135M-Instruct in float32 (`tokenmill models real`), where generation, not the engine's start-up,
is most of the work, as on a GPU's night of real documents.

With `--per-token`, each side's seconds per output token after its engine start: tokenmill's busy seconds (its
manifest) over its output tokens; the peer's wall seconds less those of a run of its runner on the file's first
request alone (its start-up, that one request and its shutdown) over its output tokens; and their ratio.

Usage: python benchmarks/batch_api.py [REQUESTS (200)] [--real] [--max-tokens N (32)] [--files duplicates,distinct]
       [--per-token]
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SYSTEM = "You are a careful analyst. Summarize documents faithfully and briefly."


def request(custom_id: str, text: str, max_tokens: int) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "gpt-4o-mini",
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Summarize:\n\n{text}"}],
            "max_tokens": max_tokens,
            "temperature": 0,
        },
    }


def batch_files(folder: Path, n: int, rng: random.Random, max_tokens: int) -> tuple[dict[str, Path], int]:
    """({"duplicates": a file with ~30% duplicates and 2 over-long documents, "distinct": one with none},
    how many duplicates the first holds)."""
    from pipeline.dev.samples import synthetic_document

    def lines(texts: list[str]) -> str:
        return "".join(json.dumps(request(f"r{i}", t, max_tokens)) + "\n" for i, t in enumerate(texts))

    originals = [synthetic_document(rng, 10) for _ in range(int(n * 0.7) - 2)]
    texts = list(originals)
    while len(texts) < n - 2:
        source = rng.choice(originals)
        # exact, or a near copy: one common word changed (no number, date or name, which the guards protect)
        texts.append(source if rng.random() < 0.5 else source.replace(" the ", " this ", 1))
    planted = len(texts) - len(originals)
    texts += [" ".join(synthetic_document(rng, 10) for _ in range(8)) for _ in range(2)]  # over the context
    rng.shuffle(texts)
    paths = {}
    for name, body in (
        ("duplicates", lines(texts)),
        ("distinct", lines([synthetic_document(rng, 10) for _ in range(n)])),
    ):
        (folder / name).mkdir(parents=True)
        paths[name] = folder / name / "batch.jsonl"
        paths[name].write_text(body)
    return paths, planted


def model_tier(real: bool) -> tuple[Path, str, object]:
    """(config file, tier name, tier config) both sides run: configs/local.yaml's large tier (SmolLM2-135M float32)
    when `real`, else configs/tiny.yaml's small tier (random weights)."""
    from pipeline import load_config

    config_path = Path(__file__).resolve().parents[1] / "configs" / ("local.yaml" if real else "tiny.yaml")
    name = "large" if real else "small"
    return config_path, name, load_config(config_path).tiers[name]


def scratch() -> tempfile.TemporaryDirectory:
    """The run's work folder: in memory where the machine has /dev/shm."""
    return tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)


def peer(path: Path, out: Path, tier) -> dict:
    """vLLM's own batch runner over the file: wall seconds (its engine-seconds), answered, errors."""
    v = tier.vllm
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.run_batch", "-i", str(path), "-o", str(out),
        "--model", tier.model, "--served-model-name", "gpt-4o-mini", "--max-model-len", str(v.max_model_len),
        "--max-num-seqs", str(v.max_num_seqs), "--max-num-batched-tokens", str(v.max_num_batched_tokens),
        "--dtype", v.dtype or "auto", "--enforce-eager", "--enable-prefix-caching",
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(tier.cpu_kvcache_space_gib)}
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"run_batch failed ({done.returncode}): {done.stderr[-2000:]}")
    results = [json.loads(line) for line in out.read_text().splitlines()]
    answered = sum(1 for r in results if r.get("error") is None and (r.get("response") or {}).get("status_code") == 200)
    tokens = sum(
        ((r.get("response") or {}).get("body") or {}).get("usage", {}).get("completion_tokens", 0) for r in results
    )
    return {"wall_seconds": round(seconds, 1), "engine_seconds": round(seconds, 1), "answered": answered,
            "errors": len(results) - answered, "output_tokens": tokens}  # fmt: skip


def tokenmill(
    folder: Path, work: Path, name: str, config_path: Path, tier: str, max_tokens: int, job_id: str | None = None
) -> dict:
    """tokenmill over the batch file(s) in `folder`: its output, catalog and cache under `work/name` (kept from
    one call to the next with the same `name`: a later night's job reuses an earlier one's answers)."""
    from pipeline import load_config, run_job
    from pipeline.generate.engine import shutdown_engines

    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_") or k == "TOKENMILL_HOME"}
    env.update(
        {
            "TOKENMILL_INPUT__URI": str(folder),
            "TOKENMILL_OUTPUT__URI": str(work / name / "out"),
            "TOKENMILL_STATE__URL": f"sqlite:///{work / name}/state.db",
            "TOKENMILL_CACHE__PATH": str(work / name / "cache"),
            "TOKENMILL_RUN__PROGRESS": "off",
            "TOKENMILL_DEDUP__SHADOW_RATE": "0",
            "TOKENMILL_ROUTE__ESCALATION__ENABLED": "false",
            f"TOKENMILL_TIERS__{tier.upper()}__SERVED_MODEL_NAMES": '["gpt-4o-mini"]',
            "TOKENMILL_SAMPLING__MAX_TOKENS": str(max_tokens),
            # (configs/local.yaml's loop knob: the peer's requests ask for none, so neither do tokenmill's)
            "TOKENMILL_SAMPLING__FREQUENCY_PENALTY": "0",
        }
    )
    config = load_config(config_path, environ=env)
    started = time.perf_counter()
    manifest = run_job(config, job_id=job_id or f"batch-{name}", release_engines=True).manifest.as_json()
    seconds = time.perf_counter() - started
    shutdown_engines()
    counts = next(iter(manifest["batches"].values()))["request_counts"]
    engines = manifest["engines"].values()
    figure = {
        k: round(sum(e.get(f"{k}_seconds", 0.0) for e in engines), 1) for k in ("held", "startup", "busy", "idle")
    }
    return {
        "wall_seconds": round(seconds, 1),
        "engine_seconds": figure.pop("held"),
        **{f"engine_{k}_seconds": v for k, v in figure.items()},
        "answered": counts["completed"],
        "errors": counts["failed"],
        "by_source": manifest["counts"]["by_source"],
        "output_tokens": sum(e.get("output_tokens", 0) for e in engines),
    }


if __name__ == "__main__":
    import argparse

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.common import emit

    args = argparse.ArgumentParser()
    args.add_argument("requests", type=int, nargs="?", default=200)
    args.add_argument("--real", action="store_true", help="configs/local.yaml's large tier: SmolLM2-135M float32")
    args.add_argument("--max-tokens", type=int, default=32)
    args.add_argument("--files", default="duplicates,distinct")
    args.add_argument(
        "--per-token",
        action="store_true",
        help="also seconds per output token after each side's engine start: the peer's start measured by a run of "
        "its runner on the file's first request alone, tokenmill's as its manifest's busy seconds",
    )
    a = args.parse_args()
    config_path, tier_name, tier = model_tier(a.real)
    with scratch() as tmp:
        work = Path(tmp)
        files, planted = batch_files(work / "in", a.requests, random.Random(11), a.max_tokens)
        figures = {}
        for name in a.files.split(","):
            path = files[name]
            theirs = peer(path, work / f"{name}-peer.jsonl", tier)
            ours = tokenmill(path.parent, work, name, config_path, tier_name, a.max_tokens)
            if a.per_token:
                one = work / f"{name}-one" / "batch.jsonl"
                one.parent.mkdir()
                one.write_text(path.read_text().splitlines()[0] + "\n")
                fixed = peer(one, work / f"{name}-one-peer.jsonl", tier)
                theirs["ms_per_output_token"] = round(
                    1000 * (theirs["wall_seconds"] - fixed["wall_seconds"]) / max(theirs["output_tokens"], 1), 2
                )
                theirs["fixed_seconds (one request alone)"] = fixed["wall_seconds"]
                ours["ms_per_output_token"] = round(
                    1000 * ours["engine_busy_seconds"] / max(ours["output_tokens"], 1), 2
                )
            figures[name] = {
                "requests": a.requests,
                "planted_duplicates": planted if name == "duplicates" else 0,
                "peer (vllm run_batch)": theirs,
                "tokenmill": ours,
                "engine_seconds_ratio": round(ours["engine_seconds"] / theirs["engine_seconds"], 3),
                **(
                    {"per_token_ratio": round(ours["ms_per_output_token"] / theirs["ms_per_output_token"], 3)}
                    if a.per_token
                    else {}
                ),
                "target_ratio": 0.75 if name == "duplicates" else 1.1,
            }
        emit("batch_api", {"model": tier.model.rsplit("/", 1)[-1], "max_tokens": a.max_tokens, **figures})
