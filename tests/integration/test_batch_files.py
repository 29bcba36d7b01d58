"""Batch files in and out (ingest/batch.py, output/batch.py): an OpenAI or Anthropic batch file runs as a job,
and its answers come back in the file format its client reads, one line per input line."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline import run_job
from pipeline.job.manifest import refresh_manifest
from tests.conftest import read_kind
from tests.jobs import assert_exactly_once

SYSTEM = "You are a careful analyst. Summarize documents faithfully and briefly."
DOC = (
    "The harbour authority approved a new ferry timetable on Tuesday. Crossings to the island will run every "
    "forty minutes from March, and the night service is extended until one in the morning during the summer. "
    "Residents had asked for more evening crossings for years, and the operator says the two new vessels "
    "delivered last autumn make the denser timetable possible without raising fares for island residents."
)
NEAR = DOC.replace("without raising fares", "without any rise in fares")  # no number, date or name changed
OTHER = "A bakery in the old town won the regional bread prize for its rye loaf, made with a sourdough kept since 1950."


def chat(custom_id, text, model="gpt-4o-mini", system=SYSTEM, **body):
    messages = [{"role": "system", "content": system}, {"role": "user", "content": f"Summarize:\n\n{text}"}]
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": model, "messages": messages, "max_tokens": 24, **body},
    }


def batch_lines() -> list:
    return [
        chat("r1", DOC),
        chat("r2", DOC),  # the same request: reused, never generated twice
        chat("r3", NEAR),  # one word apart: a near duplicate
        chat("r4", DOC, system="Answer in French."),  # another template: its own answer
        chat("r5", OTHER, temperature=0.7, seed=3, max_completion_tokens=12),
        {"custom_id": "r6", "url": "/v1/completions", "method": "POST", "body": {"model": "small", "prompt": OTHER}},
        "{not json",
        chat("r8", OTHER, n=2),
        chat("r9", OTHER, tools=[{"type": "function", "function": {"name": "f"}}]),
        {**chat("r10", OTHER), "body": {"model": "gpt-4o-mini", "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}},
        chat("r11", OTHER, model="no-such-model"),
        chat("r1", OTHER),  # a custom_id repeated: the first wins
        {**chat("r13", OTHER), "url": "/v1/embeddings"},
    ]  # fmt: skip


def write_batch(folder: Path, lines: list, name: str = "nightly.jsonl") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def config(make_config, tmp_path):
    write_batch(tmp_path / "input", batch_lines())
    return make_config(tiers__small__served_model_names=["gpt-4o-mini"], dedup__shadow_rate=0)


def results(config, manifest, file="nightly.jsonl") -> dict[str, list[dict]]:
    entry = manifest["batches"][file]
    return {kind: read_jsonl(Path(config.output.uri) / path) for kind, path in entry["files"].items()}


def test_a_batch_file_gets_one_line_per_request_answers_and_errors_apart(config):
    manifest = run_job(config, job_id="b1").manifest.as_json()
    out = results(config, manifest)
    answered = {line["custom_id"]: line for line in out["output"]}
    # OpenAI's shape: a refused request's error object in `response.body.error`, the top-level `error` null.
    assert all(line["error"] is None and line["response"]["status_code"] == 400 for line in out["errors"])
    errors = [(line["custom_id"], line["response"]["body"]["error"]["code"]) for line in out["errors"]]
    assert len(out["output"]) + len(out["errors"]) == len(batch_lines())  # one line per input line, always
    assert sorted(answered) == ["r1", "r2", "r3", "r4", "r5", "r6"]
    assert errors == [
        (None, "malformed_json"),
        ("r8", "unsupported_request"),
        ("r9", "unsupported_request"),
        ("r10", "unsupported_request"),
        ("r11", "unknown_model"),
        ("r1", "duplicate_id"),
        ("r13", "unsupported_request"),
    ]
    assert manifest["batches"]["nightly.jsonl"]["request_counts"] == {"total": 13, "completed": 6, "failed": 7}
    by_code = {line["custom_id"]: line["response"]["body"]["error"]["message"] for line in out["errors"]}
    assert "`n`" in by_code["r8"] and "tools" in by_code["r9"] and "image_url" in by_code["r10"]
    assert "no-such-model" in by_code["r11"] and "gpt-4o-mini" in by_code["r11"]

    # Each answer is the OpenAI batch output line, its content the Parquet output's.
    rows = {r["id"]: r for r in pq.read_table(Path(config.output.uri) / "outputs").to_pylist()}
    for custom_id, line in answered.items():
        body = line["response"]["body"]
        assert line["response"]["status_code"] == 200 and line["error"] is None
        text = body["choices"][0]["text"] if custom_id == "r6" else body["choices"][0]["message"]["content"]
        assert text == rows[custom_id]["summary"]
        assert body["usage"]["prompt_tokens"] == rows[custom_id]["prompt_tokens"]
        assert body["usage"]["completion_tokens"] == rows[custom_id]["output_tokens"]
        assert "cached_tokens" in body["usage"]["prompt_tokens_details"]
    assert answered["r1"]["response"]["body"]["model"] == "gpt-4o-mini"  # the name asked for, echoed
    assert answered["r6"]["response"]["body"]["object"] == "text_completion"
    # The same request is answered once and reused; another template or sampling is its own generation.
    content = {k: v["response"]["body"]["choices"][0].get("message", {}).get("content") for k, v in answered.items()}
    assert content["r2"] == content["r1"] and answered["r2"]["tokenmill"]["source"] == "duplicate_in_job"
    assert answered["r3"]["tokenmill"]["source"] == "near_duplicate" and content["r3"] == content["r1"]
    assert answered["r4"]["tokenmill"]["source"] == "generated" and content["r4"] != content["r1"]
    assert answered["r2"]["tokenmill"]["cost_usd"] == 0 and answered["r1"]["tokenmill"]["cost_usd"] > 0
    # The request's own sampling: its output budget holds.
    assert answered["r5"]["response"]["body"]["usage"]["completion_tokens"] <= 12


def test_a_rerun_writes_the_same_lines_and_a_new_job_pays_nothing(config):
    first = run_job(config, job_id="b1").manifest.as_json()
    before = results(config, first)
    again = run_job(config, job_id="b1").manifest.as_json()  # the same job: nothing to do, the files written again
    assert results(config, again) == before
    second = run_job(
        config, job_id="b2"
    ).manifest.as_json()  # the next night, the same file: every answer from the cache
    out = results(config, second)
    assert [line["custom_id"] for line in out["output"]] == [line["custom_id"] for line in before["output"]]
    assert all(line["tokenmill"]["cost_usd"] == 0 for line in out["output"])
    assert all(line["tokenmill"]["source"] != "generated" for line in out["output"])
    assert [line["response"]["body"]["choices"][0] for line in out["output"]] == [
        line["response"]["body"]["choices"][0] for line in before["output"]
    ]


def test_an_anthropic_batch_file_gets_one_results_file(make_config, tmp_path):
    def request(custom_id, text, **params):
        messages = [{"role": "user", "content": f"Summarize:\n\n{text}"}]
        return {
            "custom_id": custom_id,
            "params": {"model": "claude-haiku", "max_tokens": 20, "system": SYSTEM, "messages": messages, **params},
        }

    lines = [
        request("a1", DOC),
        request("a2", DOC),
        request("a3", OTHER, stop_sequences=["."]),
        {"custom_id": "a4", "params": {"model": "claude-haiku", "messages": [{"role": "user", "content": "x"}]}},
        request("a5", OTHER, tools=[{"name": "t"}]),
    ]
    write_batch(tmp_path / "input", lines, "messages.jsonl")
    config = make_config(tiers__small__served_model_names=["claude-haiku"], dedup__shadow_rate=0)
    manifest = run_job(config, job_id="a").manifest.as_json()
    out = results(config, manifest, "messages.jsonl")["results"]
    assert [(r["custom_id"], r["result"]["type"]) for r in out] == [
        ("a1", "succeeded"),
        ("a2", "succeeded"),
        ("a3", "succeeded"),
        ("a4", "errored"),
        ("a5", "errored"),
    ]
    message = out[0]["result"]["message"]
    assert message["type"] == "message" and message["model"] == "claude-haiku"
    assert message["content"][0]["text"] == out[1]["result"]["message"]["content"][0]["text"]
    assert message["usage"]["output_tokens"] <= 20 and message["stop_reason"] in ("end_turn", "max_tokens")
    assert "max_tokens" in out[3]["result"]["error"]["error"]["message"]
    assert out[4]["result"]["error"]["error"]["type"] == "invalid_request_error"


def test_a_stopped_job_returns_what_it_has_and_says_the_rest_expired(make_config, tmp_path):
    """A batch's job stopped for good (its window over) after its first wave: each partition (two requests each)
    is committed with what it has, a cache hit of an earlier job included; the long document whose chunks were
    summarised but whose reduce never ran is `expired`, and so is its copy in another partition, its chunks'
    GPU time in `unfinished` ledger rows once; every line once, every GPU-second in the ledger. (The Batch
    API's cancel takes the same path: tests/system/test_batch_api.py.)"""
    from pipeline.job import faults
    from pipeline.job.drain import drain
    from pipeline.job.lifecycle import Job
    from pipeline.job.plan import plan
    from pipeline.job.prepare import prepare_or_fail

    def request(custom_id, text):
        messages = [{"role": "user", "content": f"Summarize:\n\n{text}"}]
        return {"custom_id": custom_id, "params": {"model": "claude-haiku", "max_tokens": 20, "messages": messages}}

    config = make_config(
        tiers__small__served_model_names=["claude-haiku"], dedup__shadow_rate=0, input__records_per_partition=2
    )
    write_batch(tmp_path / "input", [request("a1", DOC)], "messages.jsonl")
    run_job(config, job_id="first")  # pays for a1's answer, and caches it
    long = "revenue growth customer order shipment " * 900  # over the tiny tier's context: map, then reduce
    lines = [request("a1", DOC), request("a2", OTHER), {"custom_id": "a3"}, request("a4", long), request("a5", long)]
    write_batch(tmp_path / "input", lines, "messages.jsonl")
    job = Job.open(config, "second")
    plan(job.ctx.planning())
    waves = []

    def stop_after_the_first_wave(point, job_id, partition):
        if point == "wave_written" and job_id == "second":
            waves.append(partition)
            if waves.count(partition) > 1:  # the reduce's wave: the job stops here, as a killed worker leaves it
                raise OSError("stopped")

    with faults.inject(stop_after_the_first_wave):
        for p in job.ctx.state.partitions("second"):
            prepare_or_fail(job.ctx.preparing(), p.partition)
        drain(job.ctx.draining(), "small")
    assert job.end_stopped("expired", "the batch's completion_window ended before this request ran") == []
    assert job.ctx.state.job("second").status == "expired"
    out = results(config, refresh_manifest(job.ctx.manifests()).as_json(), "messages.jsonl")["results"]
    assert [(r["custom_id"], r["result"]["type"]) for r in out] == [
        ("a1", "succeeded"),
        ("a2", "succeeded"),
        ("a3", "errored"),
        ("a4", "expired"),
        ("a5", "expired"),
    ]
    ledger = read_kind(tmp_path / "output", "ledger", "second").to_pylist()
    assert {r["id"]: r["source"] for r in ledger if r["kind"] == "output"} == {"a1": "cache_exact", "a2": "generated"}
    unfinished = [r for r in ledger if r["kind"] == "unfinished"]
    assert len(unfinished) >= 2 and len({r["id"] for r in unfinished}) == 1  # one copy's chunk summaries, paid
    quarantine = {r["id"]: r["reason"] for r in read_kind(tmp_path / "output", "quarantine", "second").to_pylist()}
    assert quarantine["a4"] == quarantine["a5"] == "expired"
    assert len({p.partition for p in job.ctx.state.partitions("second")}) == 3
    state_db = config.state.url.removeprefix("sqlite:///")
    assert_exactly_once(tmp_path / "output", "second", {"ids": ["a1", "a2", "a4", "a5"], "bad_records": 1}, state_db)
    # Nothing of it runs again: a later run of the job finds every partition committed and no unit to serve.
    assert all(p.status == "succeeded" for p in job.ctx.state.partitions("second"))
    assert not job.ctx.queue.claimable("second", "small")


def test_a_document_file_beside_a_batch_file_writes_no_batch_results(make_config, tmp_path):
    write_batch(tmp_path / "input", [chat("r1", DOC)])
    (tmp_path / "input" / "docs.jsonl").write_text(json.dumps({"id": "d1", "text": OTHER}) + "\n")
    config = make_config(tiers__small__served_model_names=["gpt-4o-mini"])
    manifest = run_job(config, job_id="mixed").manifest.as_json()
    assert list(manifest["batches"]) == ["nightly.jsonl"]
    assert manifest["counts"]["outputs"] == 2


def test_a_line_that_is_not_json_is_named_by_the_custom_id_its_text_still_holds():
    from pipeline.output.batch import recovered_id

    assert recovered_id('{"custom_id": "r\\"7", "body": {') == 'r"7'
    assert recovered_id("{not json") is None and recovered_id('{"custom_id": 7, ') is None
