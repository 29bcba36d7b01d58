"""How close the pre-flight estimate comes to what a job then costs, on the demo corpus and on held-out real text.

Three real jobs, each a `tokenmill run` of its own (a fresh process: every job pays the engine's cold start,
as a user's does), each in an output root and cache of its own, so that no job reuses another's outputs and
each estimate sees only the ledger it is meant to learn from:

  history   a slice of the hold-out set's real text (pipeline/dev/holdout.py: this machine's READMEs,
            copyright files, licences, man pages, docstrings); its ledger is what the estimates learn from
  demo      the demo corpus as `tokenmill samples` writes it (real text of this machine, seed 101, with
            duplicates, near duplicates and bad records), estimated from the history job's ledger, then run
  held-out  another slice of the hold-out set (documents in neither the history slice nor the demo corpus)
            plus should- and must-not-reuse variants of them, estimated from the history job's ledger, then run
  mixed     a first night of another kind, estimated with no ledger (its own output root), then run: a third
            slice of the hold-out set with exact duplicates, near-duplicate variants, long documents (several
            documents joined, past the tiers' context: map-reduce) and three tenants

Per corpus: the estimate's low / mid / high against the actual cost (the manifest's cost.cost_usd, what
`tokenmill run` prints as "cost": busy time, engine start-up and idle), the midpoint's error, whether the
range holds the actual, and predicted against measured output tokens and escalations. The estimate of the
history job itself, made with no ledger, is printed too: priced by the hardware projection of each tier's model on
its device (pipeline/plan/hardware.py; this CPU's limits from the cached probe), the first night's estimate of a new
deployment, as is the mixed corpus's. `--cold-only` runs just those two jobs and their estimates.

Run it under the engine lock (one engine on the machine at a time), after `make models`:

    flock /tmp/tokenmill-engine.lock python benchmarks/estimate_accuracy.py [--config configs/local.yaml]
        [--history-documents 24] [--holdout-documents 40] [--variants 10] [--cold-only]
        [--set section__field=value ...]

Prints one JSON line (benchmarks/common.py `emit`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import emit  # noqa: E402
from pipeline import estimate_job, load_config  # noqa: E402
from pipeline.dev.holdout import collect, make_variants  # noqa: E402
from pipeline.dev.samples import write_sample_corpus  # noqa: E402
from pipeline.output.ledger import connect  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TENANTS = ("acme", "globex", "initech")


def mixed(docs: list[dict], seed: int = 7) -> list[dict]:
    """`docs`, then an exact copy of every fifth, near-duplicate variants of a tenth, and a long document per
    eighth (five to eight of the others joined: past both tiny tiers' context, so chunked and reduced)."""
    rng = random.Random(seed)
    docs = [{**d, "tenant": TENANTS[i % len(TENANTS)]} for i, d in enumerate(docs)]
    copies = [{**d, "id": f"copy-{i:03d}"} for i, d in enumerate(docs[::5])]  # the same tenant: a duplicate
    variants = make_variants(docs, max(len(docs) // 10, 1), seed=seed)
    long = [
        {"id": f"long-{i:03d}", "text": "\n\n".join(d["text"] for d in rng.sample(docs, rng.randint(5, 8)))}
        for i in range(max(len(docs) // 8, 1))
    ]
    return docs + copies + variants + long


def corpora(work: Path, history_docs: int, holdout_docs: int, variants: int) -> dict[str, Path]:
    """Write the four inputs: the demo corpus, and three disjoint hold-out slices none of whose texts is in it."""
    demo_texts = [d["text"] for d in collect(60, seed=101)]  # as `tokenmill samples` (pipeline/cli/setup.py)
    write_sample_corpus(work / "demo", documents=60, texts=demo_texts)
    pool = [d for d in collect(history_docs + 2 * holdout_docs + 60, seed=0) if d["text"] not in set(demo_texts)]
    history, held = pool[:history_docs], pool[history_docs : history_docs + holdout_docs]
    other = pool[history_docs + holdout_docs : history_docs + 2 * holdout_docs]
    out = {"demo": work / "demo"}
    for name, docs in (
        ("history", history),
        ("holdout", held + make_variants(held, variants) if variants else held),
        ("mixed", mixed(other)),
    ):
        (work / name).mkdir(parents=True)
        with open(work / name / "docs.jsonl", "w", encoding="utf-8") as f:
            for i, d in enumerate(docs):
                tenant = d.get("tenant", TENANTS[i % len(TENANTS)])
                f.write(json.dumps({"id": d["id"], "text": d["text"], "tenant": tenant}) + "\n")
        out[name] = work / name
    return out


def env_for(work: Path, name: str, corpus: Path, overrides: dict[str, str], output: str | None = None) -> dict:
    """The environment giving a job its input, output root, state and cache in `work` (one root and cache per job)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_") or k == "TOKENMILL_HOME"}
    env.update(
        {
            "TOKENMILL_INPUT__URI": str(corpus),
            "TOKENMILL_OUTPUT__URI": output or str(work / f"out-{name}"),
            "TOKENMILL_STATE__URL": f"sqlite:///{work}/state.db",
            "TOKENMILL_CACHE__PATH": str(work / f"cache-{name}"),
            "TOKENMILL_RUN__PROGRESS": "off",
        }
    )
    env.update({f"TOKENMILL_{k.upper()}": v for k, v in overrides.items()})
    return env


def measured(cfg, job_id: str) -> dict:
    """From the job's ledger: generated items, their output tokens, escalations, busy and start-up/idle dollars."""
    row = (
        connect(cfg.output.uri, cfg.storage)
        .execute(
            "SELECT count(*) FILTER (WHERE source = 'generated'), sum(output_tokens), "
            "count(*) FILTER (WHERE source = 'generated' AND escalated), "
            "sum(coalesce(busy_gpu_seconds, 0) * price_per_gpu_hour / 3600), "
            "sum(coalesce(overhead_gpu_seconds, 0) * price_per_gpu_hour / 3600) FROM ledger WHERE job_id = ?",
            [job_id],
        )
        .fetchone()
    )
    return {
        "generated": row[0],
        "output_tokens": int(row[1] or 0),
        "escalated": row[2],
        "busy_usd": float(row[3] or 0),
        "start_up_and_idle_usd": float(row[4] or 0),
    }


def summary(est: dict) -> dict:
    escalations = {t: round(e["escalation"]["items"], 2) for t, e in est["tiers"].items() if "escalation" in e}
    return {
        "to_generate": est["to_generate"],
        "est_usd_low": est["est_usd_low"],
        "est_usd": est["est_usd"],
        "est_usd_high": est["est_usd_high"],
        "est_output_tokens": round(sum(t["est_output_tokens"] for t in est["tiers"].values())),
        "est_escalations": escalations,
        "methods": {t: e["method"] for t, e in est["tiers"].items()},
    }


def compare(est: dict, manifest: dict, ledger: dict, learned_from: str) -> dict:
    actual = manifest["cost"]["cost_usd"]
    return {
        "learned_from": learned_from,
        "records": manifest["counts"]["records"],
        **summary(est),
        "actual_usd": actual,
        "mid_error": round(est["est_usd"] / actual - 1, 4) if actual else None,
        "in_range": est["est_usd_low"] <= actual <= est["est_usd_high"],
        "mid_within_25pct": abs(est["est_usd"] / actual - 1) <= 0.25 if actual else None,
        "actual": ledger,
    }


def by_tier(cfg, job_id: str, est: dict) -> dict:
    """Per tier, the estimate's parts (midpoints) beside the ledger's: items, escalations, output tokens, busy
    and start-up/idle dollars, so that a midpoint off the bill shows which part is off."""
    rows = (
        connect(cfg.output.uri, cfg.storage)
        .execute(
            "SELECT tier, count(*) FILTER (WHERE source = 'generated'), count(*) FILTER (WHERE escalated), "
            "sum(output_tokens), sum(coalesce(busy_gpu_seconds, 0) * price_per_gpu_hour / 3600), "
            "sum(coalesce(overhead_gpu_seconds, 0) * price_per_gpu_hour / 3600) FROM ledger WHERE job_id = ? "
            "GROUP BY 1",
            [job_id],
        )
        .fetchall()
    )
    out = {}
    for name, t in est["tiers"].items():
        over = t.get("engine_overhead", {})
        out[name] = {
            "est": {
                "items": t["items"],
                "escalated": round(t.get("escalation", {}).get("items", 0.0), 1),
                "output_tokens": round(t["est_output_tokens"]),
                "usd": round(t["est_usd"], 5),
                "start_up_and_idle_usd": round(over.get("est_usd", 0.0), 5),
                "method": t["method"][:90],
            }
        }
    for tier, items, escalated, output, busy, overhead in rows:
        out.setdefault(tier, {})["actual"] = {
            "rows": items,
            "escalated": escalated,
            "output_tokens": int(output or 0),
            "busy_usd": round(float(busy or 0), 5),
            "start_up_and_idle_usd": round(float(overhead or 0), 5),
        }
    return out


def no_ledger_figures(est: dict, manifest: dict) -> dict:
    """How the no-ledger estimate compares with the bill: midpoint / actual (target within 1.5× either way), the
    range's width (high / low, target at most 4×), and per tier the projected busy seconds against the engine's."""
    actual = manifest["cost"]["cost_usd"]
    ratio = est["est_usd"] / actual if actual else None
    return {
        "mid_over_actual": round(ratio, 3) if ratio else None,
        "mid_within_1_5x": (1 / 1.5 <= ratio <= 1.5) if ratio else None,
        "range_width": round(est["est_usd_high"] / est["est_usd_low"], 2) if est["est_usd_low"] else None,
        "engines": {
            t: {k: e.get(k) for k in ("busy_seconds", "startup_seconds", "idle_seconds", "output_tokens")}
            for t, e in manifest.get("engines", {}).items()
        },
    }


def run(path: Path, env: dict, job_id: str) -> dict:
    """`tokenmill run` in a process of its own; its manifest (vLLM logs to stdout, so not `--json`)."""
    r = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "run", "--config", str(path), "--job-id", job_id],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        raise SystemExit(f"tokenmill run {job_id} failed ({r.returncode}): {r.stderr[-2000:]}")
    return json.loads((Path(env["TOKENMILL_OUTPUT__URI"]) / "jobs" / job_id / "manifest.json").read_text())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "local.yaml")
    parser.add_argument("--history-documents", type=int, default=24)
    parser.add_argument("--holdout-documents", type=int, default=40)
    parser.add_argument("--variants", type=int, default=10)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION__FIELD=VALUE",
        help="config override, as TOKENMILL_SECTION__FIELD (repeatable)",
    )
    parser.add_argument("--workdir", type=Path, default=None, help="keep inputs and outputs here (default: a temp dir)")
    parser.add_argument("--cold-only", action="store_true", help="only the no-ledger estimate and its job")
    args = parser.parse_args(argv)
    overrides = dict(s.split("=", 1) for s in args.set)
    started = time.monotonic()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="tokenmill-estimate-"))
    work.mkdir(parents=True, exist_ok=True)
    inputs = corpora(work, args.history_documents, args.holdout_documents, args.variants)

    env = env_for(work, "history", inputs["history"], overrides)
    history_cfg = load_config(args.config, environ=env)
    cold = estimate_job(history_cfg)  # no ledger under its output root yet: the hardware projection
    history = run(args.config, env, "history")
    results = {"history": compare(cold, history, measured(history_cfg, "history"), "nothing (hardware projection)")}
    results["history"].update(no_ledger_figures(cold, history), tiers=by_tier(history_cfg, "history", cold))
    # The mixed corpus's first night: estimated with no ledger (its own empty output root), then run.
    env = env_for(work, "mixed", inputs["mixed"], overrides)
    mixed_cfg = load_config(args.config, environ=env)
    cold = estimate_job(mixed_cfg)
    manifest = run(args.config, env, "mixed")
    results["mixed"] = compare(cold, manifest, measured(mixed_cfg, "mixed"), "nothing (hardware projection)")
    results["mixed"].update(no_ledger_figures(cold, manifest), tiers=by_tier(mixed_cfg, "mixed", cold))
    for name in () if args.cold_only else ("demo", "holdout"):
        # Estimated from the history job's ledger alone (its output root), then run in a root of its own.
        est = estimate_job(
            load_config(
                args.config, environ=env_for(work, name, inputs[name], overrides, output=history_cfg.output.uri)
            )
        )
        env = env_for(work, name, inputs[name], overrides)
        manifest = run(args.config, env, name)
        results[name] = compare(
            est, manifest, measured(load_config(args.config, environ=env), name), "the history job's ledger"
        )
    emit(
        "estimate_accuracy",
        {
            "config": str(args.config),
            "overrides": overrides,
            "workdir": str(work),
            "corpora": results,
            "seconds": round(time.monotonic() - started, 1),
        },
    )


if __name__ == "__main__":
    main()
