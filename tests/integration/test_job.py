"""Whole jobs on the fake engine (tiny models' tokenizers), checking the invariants every row relies on. The first
also runs on the real vLLM engine in tests/engine/test_jobs.py."""

import json
import os
import subprocess
import sys

import pytest

from pipeline import JobError, run_job
from pipeline.generate.fake_engine import FakeEngine
from pipeline.stores.catalog import StateStore
from tests.conftest import FAKE_ENGINE, REPO, TINY_CONFIG, read_kind
from tests.jobs import check_a_two_tier_job


def test_job_accounts_for_every_record_and_every_gpu_second(make_config, sample_corpus, tmp_path):
    check_a_two_tier_job(make_config, sample_corpus, tmp_path)


def test_rerun_of_a_job_id_replaces_rows_and_is_deterministic(make_config, sample_corpus, tmp_path):
    config = make_config()
    first = run_job(config, job_id="again")
    summaries = dict(
        zip(*(read_kind(tmp_path / "output", "outputs", "again")[c].to_pylist() for c in ("id", "summary")))
    )
    second = run_job(config, job_id="again")
    outputs = read_kind(tmp_path / "output", "outputs", "again")
    assert (
        outputs.num_rows
        == first.manifest.as_json()["counts"]["outputs"]
        == second.manifest.as_json()["counts"]["outputs"]
    )
    assert read_kind(tmp_path / "output", "ledger", "again").num_rows == outputs.num_rows
    assert dict(zip(outputs["id"].to_pylist(), outputs["summary"].to_pylist())) == summaries  # greedy: same text


def reports_with_one_odd(tmp_path, odd: int, text: str) -> None:
    """Twelve short reports in the test's input folder, report `odd` replaced by `text`."""
    input_dir = tmp_path / "input"
    input_dir.mkdir()
    docs = [{"id": f"d{i}", "text": f"report {i} on quarterly revenue and delivery"} for i in range(12)]
    docs[odd]["text"] = text
    (input_dir / "a.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))


def test_an_item_the_engine_fails_on_is_quarantined_alone(make_config, tmp_path, monkeypatch):
    reports_with_one_odd(tmp_path, 5, "POISON document that breaks the engine")
    real_add = FakeEngine.add

    def add(self, request_id, prompt, max_tokens, sampling):  # vLLM refuses a bad request when it is added
        if "POISON" in self.tokenizer.decode(prompt):
            raise RuntimeError("simulated CUDA error on this item")
        return real_add(self, request_id, prompt, max_tokens, sampling)

    monkeypatch.setattr(FakeEngine, "add", add)
    m = run_job(make_config(), job_id="poison").manifest.as_json()
    quarantine = read_kind(tmp_path / "output", "quarantine", "poison")
    assert quarantine["id"].to_pylist() == ["d5"] and quarantine["reason"].to_pylist() == ["engine_error"]
    assert "simulated CUDA error" in quarantine["detail"][0].as_py()
    assert m["counts"]["outputs"] == 11


def test_an_output_its_checks_cannot_measure_is_quarantined_alone(make_config, tmp_path, monkeypatch):
    """The output checks run on a thread beside the engine and their results are gathered when finished requests
    are stored together: one output that breaks a check is that item's quarantine row, not a lost batch."""
    from pipeline.generate import worker

    reports_with_one_odd(tmp_path, 7, "CHECKBREAKER document whose summary a check cannot measure")
    real_measure = worker.measure

    def measure(summary, document):
        if "CHECKBREAKER" in document:
            raise ValueError("a check met what it cannot read")
        return real_measure(summary, document)

    monkeypatch.setattr(worker, "measure", measure)
    m = run_job(make_config(), job_id="unchecked").manifest.as_json()
    quarantine = read_kind(tmp_path / "output", "quarantine", "unchecked")
    assert quarantine["id"].to_pylist() == ["d7"] and quarantine["reason"].to_pylist() == ["engine_error"]
    assert "output checks failed: ValueError" in quarantine["detail"][0].as_py()
    assert m["counts"]["outputs"] == 11


def test_empty_input_folder_is_a_finished_job_with_nothing_in_it(make_config, tmp_path):
    (tmp_path / "input").mkdir()
    m = run_job(make_config(), job_id="empty").manifest.as_json()
    assert m["counts"]["records"] == 0 and m["cost"]["cost_usd"] == 0


def test_a_job_that_cannot_run_is_recorded_failed(make_config, tmp_path):
    config = make_config(input_dir=tmp_path / "missing")
    with pytest.raises(JobError, match="input not found"):
        run_job(config, job_id="broken")
    (job,) = StateStore(config.state.url).jobs()
    assert job.status == "planning_failed" and "input not found" in job.error


def test_tokenmill_home_holds_state_and_models(tiny_models, tmp_path, sample_corpus):
    from pipeline.config import load_config

    home = tmp_path / "home"
    env = {
        "TOKENMILL_HOME": str(home),
        "TOKENMILL_TIERS__SMALL__MODEL": str(tiny_models / "tiny-small"),
        "TOKENMILL_TIERS__LARGE__MODEL": str(tiny_models / "tiny-large"),
        "TOKENMILL_INPUT__URI": str(sample_corpus[0]),
        "TOKENMILL_OUTPUT__URI": str(tmp_path / "out"),
        "TOKENMILL_RUN__PROGRESS": "off",
        **FAKE_ENGINE,
    }
    m = run_job(load_config(TINY_CONFIG, environ=env), job_id="home").manifest.as_json()
    assert (home / "state.db").exists() and (home / "cache" / "cache.sqlite").exists()
    # No embedding model in this home: the job runs without semantic reuse and says so.
    assert m["status"] == "succeeded" and "semantic reuse off" in m["staging"]["dedup"]["notes"][0]
    assert load_config(TINY_CONFIG, environ={"TOKENMILL_HOME": str(home)}).tiers["small"].model == str(
        home / "models" / "tiny-small"
    )


def cli(args, env, cwd):
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        cwd=cwd,
        timeout=600,
    )


def test_cli_run_end_to_end_and_one_line_failure(tiny_models, tmp_path, sample_corpus):
    env = {
        "TOKENMILL_HOME": str(tiny_models.parent),
        "TOKENMILL_STATE__URL": f"sqlite:///{tmp_path}/s.db",
        "TOKENMILL_CACHE__PATH": str(tmp_path / "cache"),
        **FAKE_ENGINE,
    }
    missing = cli(
        ["run", "--config", str(TINY_CONFIG), "--input", str(tmp_path / "nope"), "--output", str(tmp_path / "o")],
        env,
        REPO,
    )
    assert missing.returncode != 0
    assert missing.stderr.strip().splitlines()[-1].startswith("error: job failed: input not found")
    assert "Traceback" not in missing.stderr

    ok = cli(
        [
            "run",
            "--config",
            str(TINY_CONFIG),
            "--input",
            str(sample_corpus[0]),
            "--output",
            str(tmp_path / "o"),
            "--job-id",
            "cli",
        ],
        env,
        REPO,
    )
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "records" in ok.stdout and "saved vs baseline" in ok.stdout
    assert "progress:" in ok.stderr  # not a terminal: plain progress log lines
    manifest = json.loads((tmp_path / "o" / "jobs" / "cli" / "manifest.json").read_text())
    assert manifest["counts"]["records"] == sample_corpus[1]["documents"] + sample_corpus[1]["bad_records"]


def test_manifest_reports_efficiency_against_the_gpu_limits(make_config, sample_corpus):
    from pipeline.output.telemetry import GPU_PEAKS, checkpoint_size

    config = make_config(tiers__small__gpu_model="H100-SXM")  # arithmetic check: the tiny model on a named GPU
    e = run_job(config, job_id="eff").manifest.as_json()["engines"]["small"]
    params, weight_bytes = checkpoint_size(config.tiers["small"].model)
    assert params == 1_115_264 and weight_bytes == 4 * params  # fp32 tiny model, read from safetensors headers
    peak = GPU_PEAKS["H100-SXM"]
    tokens = e["uncached_prompt_tokens"] + e["output_tokens"]
    assert e["efficiency"]["mfu"] == pytest.approx(2 * params * tokens / (e["engine_seconds"] * peak["flops"]["16bit"]))
    assert e["efficiency"]["mbu"] == pytest.approx(
        weight_bytes * e["decode_steps_estimate"] / (e["engine_seconds"] * peak["bandwidth"])
    )
    assert 0 < e["efficiency"]["mfu"] < 1 and e["decode_steps_estimate"] >= 48
    unnamed = run_job(make_config(), job_id="eff-cpu").manifest.as_json()["engines"]
    assert all(v["efficiency"]["mfu"] is None for v in unnamed.values()) or unnamed == {}


def test_a_fifo_named_like_an_input_file_is_skipped_not_waited_on(make_config, tmp_path):
    """Reproducer (red team): a FIFO called `b.jsonl` blocked `run` forever, the job left `staging`."""
    import threading

    root = tmp_path / "fifo-in"
    root.mkdir()
    (root / "a.jsonl").write_text('{"id": "a", "text": "A short note about the harbour."}\n')
    os.mkfifo(root / "b.jsonl")
    done = []
    job = threading.Thread(target=lambda: done.append(run_job(make_config(root), job_id="fifo")), daemon=True)
    job.start()
    job.join(timeout=120)  # a guard against the hang the bug was, never the thing measured
    if job.is_alive():  # release the blocked reader (a writer's open unblocks it) before failing
        os.close(os.open(root / "b.jsonl", os.O_WRONLY | os.O_NONBLOCK))
    assert done, "the job blocked on the FIFO"
    m = done[0].manifest.as_json()
    assert m["status"] == "succeeded" and m["counts"]["outputs"] == 1
    assert any(s.startswith("b.jsonl: skipped, not a regular file (a FIFO)") for s in m["staging"]["skipped_files"])


def test_progress_counts_items_as_they_are_stored_before_any_partition_commits(make_config, sample_corpus):
    """The demo said "0/70 items done" for four minutes, items counting only at commit. At the first
    commit point (nothing committed yet, every generation of the job stored) the progress already counts them."""
    from pipeline.job import faults
    from pipeline.job.progress import Progress

    progress, seen = Progress("off"), []

    def watch(point, job_id, partition):
        if point == "before_commit" and not seen:
            seen.append((progress.shown, progress.done))

    with faults.inject(watch):
        run_job(make_config(), job_id="progress", progress=progress)
    shown, committed = seen[0]
    assert committed == 0 and shown > 0
    assert progress.shown == progress.done == progress.total  # and at the end, every record committed


def test_a_job_id_given_again_for_other_input_is_refused(make_config, sample_corpus, tmp_path):
    """Reproducer: a DAG run's `job_id` param naming a job staged over other input quietly continued
    that job (its partitions, its results) and reported success for input it never read."""
    from pipeline.dev.samples import write_sample_corpus

    config = make_config()
    assert run_job(config, job_id="given").manifest.as_json()["status"] == "succeeded"
    write_sample_corpus(tmp_path / "other", documents=5)
    with pytest.raises(JobError, match=r"a job's input is fixed once planned"):
        run_job(make_config(tmp_path / "other"), job_id="given")
