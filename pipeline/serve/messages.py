"""Anthropic's Message Batches API over the same batches (the `anthropic` SDK with `base_url` pointed here).

  POST   /v1/messages/batches                 create: {"requests": [{"custom_id", "params"}, ...]}
  GET    /v1/messages/batches                 list (newest first; limit, after_id, before_id)
  GET    /v1/messages/batches/{id}            retrieve
  POST   /v1/messages/batches/{id}/cancel
  GET    /v1/messages/batches/{id}/results    the results, JSONL, streamed (once the batch has ended)

A message batch is a batch of endpoint `/v1/messages` whose input file the API writes from the requests
(one Anthropic batch line each), so the runner runs it as any other; the objects are Anthropic's
(`message_batch`, RFC 3339 times, `processing_status`, `request_counts` by result type). Calls need the
`anthropic-version` header, as Anthropic's API does; the key comes as `x-api-key` (or a bearer token).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC, datetime

from fastapi import Depends, FastAPI, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from pipeline.serve.access import json_body
from pipeline.serve.errors import ApiError
from pipeline.serve.runner import ACTIVE
from pipeline.serve.store import ApiStore, Batch

ENDPOINT = "/v1/messages"
# A stopped or failed batch's requests it never answered, by how it ended: their result type.
UNANSWERED = {"cancelled": "canceled", "expired": "expired", "failed": "errored"}


class MessageRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    custom_id: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    params: dict


class CreateMessageBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    requests: list[MessageRequest] = Field(min_length=1)


def anthropic_version(request: Request) -> str:
    version = request.headers.get("anthropic-version")
    if not version:
        raise ApiError(400, "anthropic-version: header is required")
    return version


def _time(seconds: int | None) -> str | None:
    """An epoch second as Anthropic writes times: RFC 3339, UTC."""
    return None if seconds is None else datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")


def message_batch(batch: Batch, counts: dict[str, int], results_url: str) -> dict:
    """The `message_batch` object of a batch (`counts`: its requests by result type, once it has ended)."""
    ended = batch.status not in ACTIVE
    status = "ended" if ended else "canceling" if batch.cancel_requested else "in_progress"
    total = batch.request_counts.total
    ended_at = batch.ended_at()
    return {
        "id": batch.id,
        "type": "message_batch",
        "processing_status": status,
        "request_counts": {
            "processing": 0 if ended else total,
            **{k: counts.get(k, 0) for k in ("succeeded", "errored", "canceled", "expired")},
        },
        "created_at": _time(batch.created_at),
        "expires_at": _time(batch.expires_at),
        "ended_at": _time(ended_at) if ended else None,
        "cancel_initiated_at": _time(batch.cancelling_at),
        "archived_at": None,
        "results_url": results_url if ended else None,
    }


def message_batch_routes(app: FastAPI, store: ApiStore, tenant, create: Callable[[str, str, int], Batch]) -> None:
    """The routes; `create(tenant, input file id, requests)` creates a batch of endpoint /v1/messages."""
    version = [Depends(anthropic_version)]
    results = Results(store)

    def answer(batch: Batch, request: Request) -> dict:
        url = f"{str(request.base_url).rstrip('/')}/v1/messages/batches/{batch.id}/results"
        return message_batch(batch, results.counts(batch), url)

    def owned(batch_id: str, who: str) -> Batch:
        batch = store.batch(who, batch_id)
        if batch is None or batch.endpoint != ENDPOINT:
            raise ApiError(404, f"no message batch {batch_id!r}")
        return batch

    @app.post("/v1/messages/batches", dependencies=version)
    def create_message_batch(
        request: Request,
        body: CreateMessageBatch = Depends(json_body(CreateMessageBatch)),
        who: str = Depends(tenant),
    ):
        seen: set[str] = set()
        for i, r in enumerate(body.requests):
            if r.custom_id in seen:
                raise ApiError(400, f"requests.{i}.custom_id: {r.custom_id!r} is used by an earlier request")
            seen.add(r.custom_id)
        data = "".join(json.dumps(r.model_dump(), ensure_ascii=False) + "\n" for r in body.requests).encode()
        meta = store.add_file(who, "message_batch_requests.jsonl", "batch", data)
        return answer(create(who, meta["id"], len(body.requests)), request)

    @app.get("/v1/messages/batches", dependencies=version)
    def list_message_batches(
        request: Request,
        limit: int = Query(20, ge=1, le=1000),
        after_id: str | None = None,
        before_id: str | None = None,
        who: str = Depends(tenant),
    ):
        batches = [b for b in store.batches(who) if b.endpoint == ENDPOINT]  # newest first
        ids = [b.id for b in batches]
        if after_id is not None:
            batches = batches[ids.index(after_id) + 1 :] if after_id in ids else []
        elif before_id is not None:
            batches = batches[: ids.index(before_id)][::-1] if before_id in ids else []
        data = [answer(b, request) for b in batches[:limit]]
        data = data[::-1] if before_id is not None and after_id is None else data
        return {
            "data": data,
            "has_more": len(batches) > limit,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
        }

    @app.get("/v1/messages/batches/{batch_id}", dependencies=version)
    def get_message_batch(batch_id: str, request: Request, who: str = Depends(tenant)):
        return answer(owned(batch_id, who), request)

    @app.post("/v1/messages/batches/{batch_id}/cancel", dependencies=version)
    def cancel_message_batch(batch_id: str, request: Request, who: str = Depends(tenant)):
        batch = owned(batch_id, who)
        if batch.status in ACTIVE:
            store.ask_cancel(batch_id)
            batch.cancel_requested = True
        return answer(batch, request)  # an ended batch: as it is, as Anthropic answers it

    @app.get("/v1/messages/batches/{batch_id}/results", dependencies=version)
    def message_batch_results(batch_id: str, who: str = Depends(tenant)):
        batch = owned(batch_id, who)
        if batch.status in ACTIVE:
            raise ApiError(400, f"message batch {batch_id} has not ended: its results are not ready")
        return StreamingResponse(results.lines(batch), media_type="application/x-jsonl")


class Results:
    """A message batch's results: its job's results file, or, for a batch that ended before its job wrote one
    (cancelled while queued, failed), a line per request saying how it ended."""

    def __init__(self, store: ApiStore):
        self.store = store

    def lines(self, batch: Batch) -> Iterator[bytes]:
        meta = self.store.file(batch.tenant, batch.output_file_id) if batch.output_file_id else None
        if meta is not None:
            yield from self.store.stream(meta)
            return
        for custom_id in self._custom_ids(batch):
            yield (json.dumps({"custom_id": custom_id, "result": self._unanswered(batch)}) + "\n").encode()

    def counts(self, batch: Batch) -> dict[str, int]:
        if batch.status in ACTIVE:
            return {}
        lines = b"".join(self.lines(batch)).splitlines()
        return dict(Counter(json.loads(line)["result"]["type"] for line in lines if line.strip()))

    def _custom_ids(self, batch: Batch) -> list[str]:
        meta = self.store.file(batch.tenant, batch.input_file_id)
        data = self.store.content(meta) if meta is not None else b""
        return [json.loads(line)["custom_id"] for line in data.splitlines() if line.strip()]

    @staticmethod
    def _unanswered(batch: Batch) -> dict:
        kind = UNANSWERED.get(batch.status, "errored")
        if kind != "errored":
            return {"type": kind}
        errors = (batch.errors or {}).get("data") or [{}]
        message = errors[0].get("message") or "the batch failed"
        return {"type": "errored", "error": {"type": "error", "error": {"type": "api_error", "message": message}}}
