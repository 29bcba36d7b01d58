"""A batch's input file checked while the batch is `validating`, as OpenAI checks it (`serve.validation: strict`).

A line that is not a JSON object, a line whose `url` is not the batch's `endpoint`, and a `custom_id` used
twice fail the whole batch before anything runs, each named by its 1-based `line` in the batch's `errors`
(OpenAI's codes: `invalid_json_line`, `url_mismatch`, `duplicate_custom_id`). Whatever else a line may get
wrong (an unknown model, a parameter out of range) is the request's own error line once the batch runs.
"""

from __future__ import annotations

import json

from pipeline.config import ServeConfig
from pipeline.ingest.batch import ANTHROPIC_ENDPOINT

MAX_ERRORS = 100  # lines named in `errors`: enough to fix a file, not a copy of a broken one


def request_lines(data: bytes) -> int:
    """The requests of a batch input file, as the reader counts them: its lines that are not blank."""
    return sum(1 for line in data.split(b"\n") if line.strip())


def input_errors(file_id: str, data: bytes | None, endpoint: str, limits: ServeConfig) -> dict | None:
    """The batch's `errors` for its input file `file_id`, whose content is `data` (None: the file no longer
    exists), or None when it may run: it holds a request, at most `serve.max_requests`, and under
    `serve.validation: strict` every line is one OpenAI runs (`line_errors`)."""
    if data is None:
        return batch_errors("invalid_file", f"input file {file_id} no longer exists")
    lines = request_lines(data)
    if lines == 0:
        return batch_errors("empty_file", "the input file holds no request")
    if lines > limits.max_requests:
        return batch_errors("too_many_requests", f"{lines} requests; at most {limits.max_requests}")
    if limits.validation == "strict" and (wrong := line_errors(data, endpoint)):
        return {"object": "list", "data": wrong}  # lines OpenAI refuses, each named
    return None


def batch_errors(code: str, message: str) -> dict:
    """A batch's `errors` naming one error of the whole batch (no line)."""
    return {"object": "list", "data": [{"code": code, "message": message, "param": None, "line": None}]}


def line_errors(data: bytes, endpoint: str) -> list[dict]:
    """The batch's `errors.data` entries for `data` (an input file) under `endpoint`; empty when it may run."""
    found: list[dict] = []
    seen: set[str] = set()
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        problem = _problem(raw, endpoint, seen)
        if problem is not None:
            code, param, message = problem
            found.append({"code": code, "line": number, "message": message, "param": param})
            if len(found) == MAX_ERRORS:
                break
    return found


def _problem(raw: bytes, endpoint: str, seen: set[str]) -> tuple[str, str | None, str] | None:
    """(code, param, message) of one line's problem, or None; adds its `custom_id` to `seen`."""
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        return "invalid_json_line", None, "This line is not parseable as valid JSON."
    if not isinstance(obj, dict):
        return "invalid_json_line", None, "This line is not a JSON object."
    url = obj.get("url")
    if endpoint != ANTHROPIC_ENDPOINT and url != endpoint:
        return "url_mismatch", "url", f"The line's `url` {url!r} does not match the batch's endpoint {endpoint!r}."
    custom_id = obj.get("custom_id")
    if isinstance(custom_id, str):
        if custom_id in seen:
            return "duplicate_custom_id", "custom_id", f"The custom_id {custom_id!r} is used by an earlier line."
        seen.add(custom_id)
    return None
