"""Output, batch results: the answers to a batch file in the format its client reads back.

For each input file of OpenAI batch requests, next to the Parquet tables:
  batches/job=<job>/<file>.output.jsonl   one line per answered request (OpenAI's batch output line)
  batches/job=<job>/<file>.errors.jsonl   one line per request quarantined, failed or not run
For a file of Anthropic Message Batches requests, one `<file>.results.jsonl` (`succeeded` / `errored`).

Every line of the input file gets exactly one line, in input order: the files are derived from the
committed partitions' rows in a snapshot of each table (outputs, quarantine, ledger: output/tables.py) and
the input file read again, never kept on the side, so they cannot disagree with the tables, and a rerun
writes the same files again (each atomically) instead of adding lines. A reused answer is returned as the
answer, under its own `custom_id`; the `tokenmill` extension field of each line says where it came from and
what it cost.
"""

from __future__ import annotations

import json
import re

import pyarrow as pa
import pyarrow.dataset as ds
import xxhash

from pipeline.config import TokenmillConfig
from pipeline.ingest.read import FileReader
from pipeline.output.safe_text import json_line
from pipeline.output.tables import read
from pipeline.schema import REASONS
from pipeline.stores import storage
from pipeline.stores.paths import OutputPath

# Quarantine reasons that are the server's fault, not the request's (HTTP 500 rather than 400).
SERVER_ERRORS = {"engine_error", "not_run", "unreadable_file"}
FINISH = {"stop": "end_turn", "length": "max_tokens"}  # OpenAI's finish_reason -> Anthropic's stop_reason
# Requests a stopped batch never answered: no response, OpenAI's error code, Anthropic's result type.
STOPPED = {"expired": ("batch_expired", "expired"), "cancelled": ("batch_cancelled", "canceled")}


def result_paths(job_id: str, file: str, fmt: str) -> dict[str, OutputPath]:
    kinds = ["results"] if fmt == "anthropic" else ["output", "errors"]
    return {kind: OutputPath.batch_result(job_id, file, kind) for kind in kinds}


def write_batch_results(
    config: TokenmillConfig,
    out: storage.Location,
    job_id: str,
    batch_files: dict[str, str],
    committed: set[str],
    partitions_of: dict[str, list[str]],
) -> dict[str, dict]:
    """Write the result files of each batch input file (`batch_files`: file -> format); `committed`: the
    partitions the catalog has committed; `partitions_of`: file -> its partitions.
    Returns, per input file, its result files and request counts (for the manifest)."""
    summary = {}
    root = storage.resolve(config.input.uri, config.storage)
    for file, fmt in sorted(batch_files.items()):
        partitions = [p for p in partitions_of.get(file, []) if p in committed]
        tables = {kind: _committed(out, job_id, partitions, kind) for kind in _KINDS}
        requests = FileReader(root, file, root.join(file), config.input).table()
        lines, counts, usage = _result_lines(job_id, fmt, requests, tables)
        paths = result_paths(job_id, file, fmt)
        for kind, path in paths.items():
            body = "".join(json_line(line) for line in lines[kind])
            storage.write_bytes_atomic(out, path.full(out), body.encode())
        summary[file] = {
            "format": fmt,
            "files": {k: str(p) for k, p in paths.items()},
            "request_counts": counts,
            "usage": usage,
            "models": sorted({served_name(config, t) for t in _answering_tiers(tables["outputs"])}),
        }
    return summary


def served_name(config: TokenmillConfig, tier: str) -> str:
    """The name a tier answers to in the API: its first `served_model_names`, else its name (never its path)."""
    names = config.tiers[tier].served_model_names if tier in config.tiers else []
    return names[0] if names else tier


def _answering_tiers(outputs: pa.Table | None) -> set[str]:
    return set(outputs["tier"].to_pylist()) if outputs is not None else set()


_KINDS = {
    "outputs": ["id", "summary", "tier", "source", "source_id", "prompt_tokens", "cached_prompt_tokens",
                "output_tokens", "finish_reason", "created_at"],
    "quarantine": ["id", "file", "line", "reason", "detail"],
    "ledger": ["id", "cost_usd", "kind", "attempts", "escalated"],
}  # fmt: skip


def _committed(out: storage.Location, job_id: str, partitions: list[str], kind: str) -> pa.Table | None:
    """The partitions' rows of one kind, from the table's latest snapshot (each partition whole)."""
    if not partitions:
        return None
    keep = (ds.field("job_id") == job_id) & ds.field("partition").isin(partitions)
    return read(out, kind, filter=keep, columns=_KINDS[kind])


def _result_lines(job_id: str, fmt: str, requests: pa.Table, tables: dict) -> tuple[dict[str, list], dict, dict]:
    """Per input line its result line; the request counts; and the usage the answers report, summed."""
    outputs = {r["id"]: r for r in tables["outputs"].to_pylist()} if tables["outputs"] is not None else {}
    quarantined = {}
    if tables["quarantine"] is not None:
        quarantined = {r["line"]: r for r in tables["quarantine"].to_pylist() if r["line"] is not None}
    paid = _paid(tables["ledger"])
    lines: dict[str, list] = {"output": [], "errors": [], "results": []}
    counts = {"total": 0, "completed": 0, "failed": 0}
    usage = {"prompt_tokens": 0, "cached_prompt_tokens": 0, "output_tokens": 0}
    for row in requests.to_pylist():
        counts["total"] += 1
        request = row["request"]
        custom_id, answer = row["id"] or recovered_id(row["raw_excerpt"]), outputs.get(row["id"])
        problem = quarantined.get(row["line"])
        if problem is None and answer is None:
            problem = {"reason": "not_run", "detail": "its partition has not committed: rerun the job"}
        uid = xxhash.xxh3_64_hexdigest(json.dumps([job_id, row["line"], custom_id]).encode())
        if problem is not None:
            counts["failed"] += 1
            reason, message = problem["reason"], problem["detail"] or REASONS.get(problem["reason"], problem["reason"])
            if fmt == "anthropic":
                lines["results"].append(_anthropic_error(custom_id, reason, message))
            else:
                lines["errors"].append(_openai_error(uid, custom_id, reason, message))
            continue
        counts["completed"] += 1
        for k in usage:
            usage[k] += answer[k] or 0
        extension = {"source": answer["source"], "source_id": answer["source_id"], **paid.get(custom_id, _UNPAID)}
        if fmt == "anthropic":
            lines["results"].append(_anthropic_answer(uid, custom_id, request, answer, extension))
        else:
            lines["output"].append(_openai_answer(uid, custom_id, request, answer, extension))
    return lines, counts, usage


_UNPAID = {"cost_usd": 0.0, "attempts": 0, "escalated": False}
_CUSTOM_ID = re.compile(r'"custom_id"\s*:\s*("(?:[^"\\]|\\.)*")')


def _paid(ledger: pa.Table | None) -> dict[str, dict]:
    """Per request, what the ledger says it paid: every attempt (drafts, retries, escalations, chunk summaries),
    although its `usage` reports only the attempt that produced its answer."""
    paid: dict[str, dict] = {}
    for r in ledger.to_pylist() if ledger is not None else []:
        p = paid.setdefault(r["id"], dict(_UNPAID))
        p["cost_usd"] = round(p["cost_usd"] + (r["cost_usd"] or 0.0), 10)
        p["attempts"] += r["attempts"] or 0
        p["escalated"] = p["escalated"] or bool(r["escalated"])
    return paid


def recovered_id(excerpt: str | None) -> str | None:
    """The `custom_id` a line that is not valid JSON still names (its raw text), so its error line names it."""
    match = _CUSTOM_ID.search(excerpt or "")
    if match is None:
        return None
    try:
        value = json.loads(match.group(1))
    except ValueError:
        return None
    return value if isinstance(value, str) and value else None


def _usage(answer: dict) -> dict:
    prompt, output = answer["prompt_tokens"] or 0, answer["output_tokens"] or 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": output,
        "total_tokens": prompt + output,
        "prompt_tokens_details": {"cached_tokens": answer["cached_prompt_tokens"] or 0},
    }


def _openai_answer(uid: str, custom_id: str, request: dict, answer: dict, extension: dict) -> dict:
    created = int(answer["created_at"].timestamp()) if answer["created_at"] else 0
    finish = answer["finish_reason"] if answer["finish_reason"] in ("stop", "length") else "stop"
    if request["endpoint"] == "/v1/completions":
        body = {
            "id": f"cmpl-{uid}",
            "object": "text_completion",
            "created": created,
            "model": request["model"],
            "choices": [{"index": 0, "text": answer["summary"], "logprobs": None, "finish_reason": finish}],
            "usage": _usage(answer),
        }
    else:
        body = {
            "id": f"chatcmpl-{uid}",
            "object": "chat.completion",
            "created": created,
            "model": request["model"],
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": answer["summary"], "refusal": None},
                    "logprobs": None,
                    "finish_reason": finish,
                }
            ],
            "usage": _usage(answer),
        }
    return {
        "id": f"batch_req_{uid}",
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": f"req_{uid}", "body": body},
        "error": None,
        "tokenmill": extension,
    }


def _openai_error(uid: str, custom_id: str | None, reason: str, message: str) -> dict:
    """OpenAI's error line: a refused or failed request as the HTTP response it would have had (its error object
    in `response.body.error`, top-level `error` null); a request a stopped batch never ran (no HTTP response) in
    the top-level `error`."""
    if reason in STOPPED:
        error = {"code": STOPPED[reason][0], "message": message}
        return {"id": f"batch_req_{uid}", "custom_id": custom_id, "response": None, "error": error}
    status = 500 if reason in SERVER_ERRORS else 400
    kind = "server_error" if reason in SERVER_ERRORS else "invalid_request_error"
    body = {"error": {"message": message, "type": kind, "param": None, "code": reason}}
    return {
        "id": f"batch_req_{uid}",
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": f"req_{uid}", "body": body},
        "error": None,
    }


def _anthropic_answer(uid: str, custom_id: str, request: dict, answer: dict, extension: dict) -> dict:
    usage = _usage(answer)
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    message = {
        "id": f"msg_{uid}",
        "type": "message",
        "role": "assistant",
        "model": request["model"],
        "content": [{"type": "text", "text": answer["summary"]}],
        "stop_reason": FINISH.get(answer["finish_reason"], "end_turn"),
        "stop_sequence": None,
        "usage": {
            "input_tokens": usage["prompt_tokens"] - cached,
            "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0,
            "output_tokens": usage["completion_tokens"],
        },
    }
    return {"custom_id": custom_id, "result": {"type": "succeeded", "message": message}, "tokenmill": extension}


def _anthropic_error(custom_id: str | None, reason: str, message: str) -> dict:
    if reason in STOPPED:
        return {"custom_id": custom_id, "result": {"type": STOPPED[reason][1]}}
    kind = "api_error" if reason in SERVER_ERRORS else "invalid_request_error"
    return {
        "custom_id": custom_id,
        "result": {
            "type": "errored",
            "error": {"type": "error", "error": {"type": kind, "message": f"{reason}: {message}"}},
        },
    }
