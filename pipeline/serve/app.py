"""`tokenmill serve`: an OpenAI-compatible Batch API over tokenmill jobs.

  POST   /v1/files                    upload a batch input file (multipart: file, purpose=batch, expires_after)
  GET    /v1/files, /v1/files/{id}    list (purpose, limit, after, order), retrieve
  GET    /v1/files/{id}/content       download (inputs, and a batch's output and error files)
  DELETE /v1/files/{id}
  POST   /v1/batches                  create: input_file_id, endpoint, completion_window, metadata,
                                      output_expires_after
  GET    /v1/batches, /v1/batches/{id}
  POST   /v1/batches/{id}/cancel
  GET    /v1/models                   the model names a batch request may ask for
  /v1/messages/batches...             Anthropic's Message Batches API (anthropic.py)

Objects are OpenAI's (the `openai` SDK reads them with `base_url` pointed here), with one extension on a
batch, `tokenmill`: its job id and what it cost. Every call needs its key, as `Authorization: Bearer <key>`
or `x-api-key: <key>`; the key's SHA-256 names its tenant (`tenants.<name>.api_keys`). A key sees only its
tenant's objects: any other id is 404, exactly as an id that does not exist. Every error, the framework's
too (an unknown route, a wrong method), is OpenAI's error object with a specific message (Anthropic's under
/v1/messages/), and never names a server path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import operator
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from fastapi import Depends, FastAPI, Query, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipeline.config import ServeConfig, TokenmillConfig
from pipeline.ingest.batch import ANTHROPIC_ENDPOINT, OPENAI_ENDPOINTS
from pipeline.plan.estimate import budget_problems, estimate_job
from pipeline.serve.access import BodyCap, declared_length, json_body, tenant
from pipeline.serve.errors import ApiError, error_response
from pipeline.serve.messages import message_batch_routes
from pipeline.serve.runner import ACTIVE, WINDOWS, BatchRunner, job_config
from pipeline.serve.store import ApiStore, Batch, RequestCounts, new_id
from pipeline.serve.validate import request_lines

ENDPOINTS = (*OPENAI_ENDPOINTS, ANTHROPIC_ENDPOINT)
MAX_METADATA = 16  # OpenAI's limits on a batch's metadata: pairs, and characters per key and value
MAX_KEY, MAX_VALUE = 64, 512
MIN_EXPIRY, MAX_EXPIRY = 3600, 30 * 24 * 3600  # OpenAI's bounds on `expires_after.seconds`
log = logging.getLogger(__name__)


class ExpiresAfter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    anchor: str
    seconds: int


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = Field(None)
    output_expires_after: ExpiresAfter | None = None


def expiry_seconds(anchor, seconds, param: str) -> int:
    """Seconds after its creation a file expires (`expires_after`, a batch's `output_expires_after`), within
    OpenAI's bounds: one hour to 30 days, anchored at `created_at`."""
    if anchor != "created_at":
        raise ApiError(400, f"{param}.anchor {anchor!r}: only `created_at`", "invalid_value", f"{param}.anchor")
    try:
        value = int(seconds)
    except (TypeError, ValueError):
        value = 0
    if not MIN_EXPIRY <= value <= MAX_EXPIRY:
        message = f"{param}.seconds {seconds!r}: an integer from {MIN_EXPIRY} to {MAX_EXPIRY}"
        raise ApiError(400, message, "invalid_value", f"{param}.seconds")
    return value


# What the runner keeps on a batch for itself: never shown to a client (the Airflow run's params name paths).
INTERNAL = (
    "tenant",
    "cost_usd",
    "cancel_requested",
    "attempts",
    "failed_runs",
    "airflow_run",
    "airflow_conf",
    "output_expires_after",
)


def public(batch: Batch) -> dict:
    """The batch object a client sees: OpenAI's fields, and tokenmill's extension."""
    out = {k: v for k, v in batch.as_json().items() if k not in INTERNAL}
    if batch.status in ACTIVE and batch.cancel_requested:
        out["status"] = "cancelling"
    out["tokenmill"] = {"job_id": batch.id, "cost_usd": batch.cost_usd}
    return out


def public_file(meta: dict) -> dict:
    return {k: v for k, v in meta.items() if k not in ("tenant", "content", "deleted")}


def page(objects: list, limit: int, after: str | None, key: Callable = operator.itemgetter("id")) -> dict:
    """OpenAI's list page: up to `limit` objects after the one with id `after` (in the order given; `key`: an
    object's id)."""
    if after is not None:
        ids = [key(o) for o in objects]
        objects = objects[ids.index(after) + 1 :] if after in ids else []
    data = objects[: max(1, limit)]
    return {
        "object": "list",
        "data": data,
        "first_id": key(data[0]) if data else None,
        "last_id": key(data[-1]) if data else None,
        "has_more": len(objects) > len(data),
    }


def create_app(config: TokenmillConfig, store: ApiStore, runner: BatchRunner | None = None) -> FastAPI:
    """The API over `store`; `runner`, when given, runs the batches while the app is served (started and
    closed by the app's lifespan)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if runner is not None:
            runner.start()
        try:
            yield
        finally:
            if runner is not None:
                await asyncio.to_thread(runner.close)

    app = FastAPI(
        title="tokenmill Batch API",
        docs_url=None,
        redoc_url=None,
        lifespan=lifespan,
        dependencies=[Security(tenant), Depends(declared_length)],
    )
    app.state.tenants = {digest: name for name, t in config.tenants.items() for digest in t.api_keys}
    app.state.limits = config.serve
    app.add_middleware(BodyCap, limits=config.serve)

    _error_handlers(app)
    _file_routes(app, store, config.serve, tenant)
    create = _batch_routes(app, store, config, tenant)
    # Anthropic's windows are 24 hours; a server that allows no such window gives its first.
    window = "24h" if "24h" in config.serve.completion_windows else config.serve.completion_windows[0]

    def create_message_batch(who: str, file_id: str, requests: int) -> Batch:
        return create(
            CreateBatch(input_file_id=file_id, endpoint=ANTHROPIC_ENDPOINT, completion_window=window), who, requests
        )

    message_batch_routes(app, store, tenant, create_message_batch)
    _model_routes(app, config, tenant)
    return app


def _error_handlers(app: FastAPI) -> None:
    """Every error as the caller's SDK reads it (errors.py): ours, a field of the wrong type (400, as OpenAI
    answers it), the framework's (404 unknown route, 405, a multipart body it refuses), and a fault (500,
    nothing of it shown: the server's log has it)."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return error_response(request.url.path, e.status, e.message, e.code, e.param)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request")
        return error_response(request.url.path, 400, message, "invalid_value", where)

    @app.exception_handler(StarletteHTTPException)
    async def framework(request: Request, e: StarletteHTTPException):
        messages = {
            404: f"no route {request.method} {request.url.path}",
            405: f"{request.method} is not allowed on {request.url.path}",
        }
        code = {404: "unknown_url", 405: "method_not_allowed"}.get(e.status_code)
        message = messages.get(e.status_code, str(e.detail))
        return error_response(request.url.path, e.status_code, message, code)

    @app.exception_handler(Exception)
    async def fault(request: Request, e: Exception):
        log.error("%s %s failed", request.method, request.url.path, exc_info=e)
        return error_response(request.url.path, 500, "the server failed on this request; its log says why", None)


def _model_routes(app: FastAPI, config: TokenmillConfig, tenant) -> None:
    started = int(time.time())
    names = sorted({n for name, t in config.tiers.items() for n in (name, *t.served_model_names)})

    def model(name: str) -> dict:
        return {"id": name, "object": "model", "created": started, "owned_by": "tokenmill"}

    @app.get("/v1/models")
    def list_models(who: str = Depends(tenant)):
        """The names a batch request's `model` may give (tiers and their `served_model_names`; never a path)."""
        return {"object": "list", "data": [model(n) for n in names]}

    @app.get("/v1/models/{name:path}")
    def get_model(name: str, who: str = Depends(tenant)):
        if name not in names:
            raise ApiError(404, f"no model {name!r}: GET /v1/models lists them", "model_not_found", "model")
        return model(name)


def _owned_file(store: ApiStore, file_id: str, who: str) -> dict:
    meta = store.file(who, file_id)
    if meta is None:
        raise ApiError(404, f"no file {file_id!r}", "not_found", "file_id")
    return meta


def _owned_batch(store: ApiStore, batch_id: str, who: str) -> Batch:
    batch = store.batch(who, batch_id)
    if batch is None:
        raise ApiError(404, f"no batch {batch_id!r}", "not_found", "batch_id")
    return batch


def _file_routes(app: FastAPI, store: ApiStore, limits: ServeConfig, tenant) -> None:
    too_large = f"file larger than serve.max_file_bytes ({limits.max_file_bytes} bytes)"

    @app.post("/v1/files")
    async def upload(request: Request, who: str = Depends(tenant)):
        # One file part and one field (`purpose`); BodyCap caps the bytes of the whole body.
        form = await request.form(max_files=1, max_fields=4, max_part_size=1024)
        upload, purpose = form.get("file"), form.get("purpose")
        if purpose != "batch":
            raise ApiError(400, f"purpose {purpose!r}: only `batch` files are accepted", "invalid_purpose", "purpose")
        if not isinstance(upload, UploadFile):
            raise ApiError(400, "no `file` part in the form", "missing_file", "file")
        expiry = None
        if "expires_after[anchor]" in form or "expires_after[seconds]" in form:
            expiry = expiry_seconds(
                form.get("expires_after[anchor]"), form.get("expires_after[seconds]"), "expires_after"
            )
        data = await upload.read(limits.max_file_bytes + 1)
        if len(data) > limits.max_file_bytes:
            raise ApiError(413, too_large, "too_large")
        store.delete_expired(who)
        return public_file(store.add_file(who, upload.filename or "upload.jsonl", "batch", data, expiry))

    @app.get("/v1/files")
    def list_files(
        purpose: str | None = None,
        limit: int = Query(10000, ge=1, le=10000),
        after: str | None = None,
        order: Literal["asc", "desc"] = "desc",
        who: str = Depends(tenant),
    ):
        """The tenant's files by `created_at` (newest first unless `order=asc`); expired ones deleted first."""
        store.delete_expired(who)
        files = [public_file(f) for f in store.files(who, purpose)]
        return page(files if order == "asc" else files[::-1], limit, after)

    @app.get("/v1/files/{file_id}")
    def get_file(file_id: str, who: str = Depends(tenant)):
        return public_file(_owned_file(store, file_id, who))

    @app.get("/v1/files/{file_id}/content")
    def file_content(file_id: str, who: str = Depends(tenant)):
        return StreamingResponse(store.stream(_owned_file(store, file_id, who)), media_type="application/jsonl")

    @app.delete("/v1/files/{file_id}")
    def delete_file(file_id: str, who: str = Depends(tenant)):
        meta = _owned_file(store, file_id, who)
        store.delete_file(meta)
        store.remove_copies(meta)
        return {"id": file_id, "object": "file", "deleted": True}


def new_batch(body: CreateBatch, tenant: str, limits: ServeConfig) -> Batch:
    """A batch object as created (`validating`), after checking what the client asked for."""
    if body.endpoint not in ENDPOINTS:
        raise ApiError(400, f"endpoint {body.endpoint!r}: one of {', '.join(ENDPOINTS)}", "invalid_endpoint")
    if body.completion_window not in limits.completion_windows or body.completion_window not in WINDOWS:
        allowed = ", ".join(w for w in limits.completion_windows if w in WINDOWS)
        raise ApiError(400, f"completion_window {body.completion_window!r}: one of {allowed}", "invalid_window")
    expiry, where = body.output_expires_after, "output_expires_after"
    metadata = body.metadata or {}
    if len(metadata) > MAX_METADATA or any(len(k) > MAX_KEY or len(v) > MAX_VALUE for k, v in metadata.items()):
        raise ApiError(400, f"metadata: at most {MAX_METADATA} pairs, keys {MAX_KEY} and values {MAX_VALUE} chars")
    now = int(time.time())
    return Batch(
        id=new_id("batch"),
        object="batch",
        endpoint=body.endpoint,
        errors=None,
        input_file_id=body.input_file_id,
        completion_window=body.completion_window,
        status="validating",
        output_file_id=None,
        error_file_id=None,
        created_at=now,
        in_progress_at=None,
        expires_at=now + WINDOWS[body.completion_window],
        finalizing_at=None,
        completed_at=None,
        failed_at=None,
        expired_at=None,
        cancelling_at=None,
        cancelled_at=None,
        request_counts=RequestCounts(total=0, completed=0, failed=0),
        metadata=metadata or None,
        model=None,
        tenant=tenant,
        output_expires_after=None if expiry is None else expiry_seconds(expiry.anchor, expiry.seconds, where),
    )


class EstimateQueue:
    """One budget estimate at a time per tenant, with at most `bound` more of its creates waiting for their turn
    (each waits in a worker thread of the server: the bound keeps one tenant from taking them all); the next
    one is refused (429). Tenants have a queue each, so one tenant's large estimates never delay another's."""

    def __init__(self, bound: int):
        self.bound = bound
        self.guard = threading.Lock()
        self.turns: dict[str, threading.Lock] = {}
        self.queued: dict[str, int] = {}  # tenant -> its creates estimating or waiting to

    @contextlib.contextmanager
    def turn(self, tenant: str):
        with self.guard:
            if self.queued.get(tenant, 0) > self.bound:
                raise ApiError(
                    429,
                    f"{self.queued[tenant]} batches of this tenant are being estimated or wait to: retry",
                    "estimate_busy",
                )
            self.queued[tenant] = self.queued.get(tenant, 0) + 1
            lock = self.turns.setdefault(tenant, threading.Lock())
        try:
            with lock:
                yield
        finally:
            with self.guard:
                self.queued[tenant] -= 1


class BudgetCheck:
    """With `budget:` caps, a batch whose estimate crosses its tenant's (or the job) cap is refused in the call that
    creates it (400, `budget_exceeded`), with the estimate. The estimate is `tokenmill estimate`'s on the batch's
    own job, exact cache hits free (a file submitted again costs nothing), compared as the job's budget guard
    compares (busy time, escalations in): it plans and tokenises the file inside the call, so only for files of
    at most `serve.estimate_max_requests` requests, and one at a time per tenant (`EstimateQueue`): a tenant's
    estimates never hold up another's. The job checks the caps again when it starts, against what it has spent
    by then, and before every engine call."""

    def __init__(self, config: TokenmillConfig, store: ApiStore):
        self.config, self.store = config, store
        self.queue = EstimateQueue(config.serve.estimate_queue)

    def applies(self, tenant: str) -> bool:
        b = self.config.budget
        return self.config.serve.estimate_max_requests > 0 and (
            b.max_job_usd is not None or b.tenant_cap(tenant) is not None
        )

    def check(self, batch: Batch, data: bytes) -> None:
        if request_lines(data) > self.config.serve.estimate_max_requests:
            return  # too large to plan inside a call: its job's own check refuses it when it starts
        try:
            with self.queue.turn(batch.tenant), tempfile.TemporaryDirectory(prefix="tokenmill-admission-") as d:
                Path(d, "input.jsonl").write_bytes(data)
                est = estimate_job(job_config(self.config, self.store, batch), input_uri=d, cached=True)
        except ApiError:
            raise
        except Exception:  # no estimate is no reason to refuse: the job's own check still applies
            log.exception("batch %s: no budget estimate in the call; its job checks the caps when it starts", batch.id)
            return
        busy = est["tenants_busy_usd"]
        problems = budget_problems(self.config, sum(busy.values()), busy)
        if problems:
            message = (
                f"refused before any work: estimated {'; '.join(problems)} (the whole job, start-up and idle in: "
                f"${est['est_usd_low']:.6f}-${est['est_usd_high']:.6f}; {est['to_generate']} generations, "
                f"{est['cache_hits']} requests answered by the cache at $0)"
            )
            raise ApiError(400, message, "budget_exceeded")


def _batch_routes(app: FastAPI, store: ApiStore, config: TokenmillConfig, tenant):
    """OpenAI's batches routes; returns how a batch is created (the Message Batches API creates its own so)."""
    limits, budget = config.serve, BudgetCheck(config, store)

    def create(body: CreateBatch, who: str, requests: int = 0) -> Batch:
        batch = new_batch(body, who, limits)
        meta = _owned_file(store, body.input_file_id, who)
        if meta["purpose"] != "batch":
            raise ApiError(400, f"file {body.input_file_id} is not a batch input file", "invalid_file")
        if budget.applies(who):
            budget.check(batch, store.content(meta))
        batch.request_counts.total = requests  # known already when the API wrote the file itself
        if not store.add_batch(batch, limits.max_active_batches):
            message = f"this tenant has {limits.max_active_batches} batches queued or running: retry when one ends"
            raise ApiError(429, message, "too_many_batches")
        return batch

    @app.post("/v1/batches")
    def create_batch(body: CreateBatch = Depends(json_body(CreateBatch)), who: str = Depends(tenant)):
        return public(create(body, who))

    @app.get("/v1/batches")
    def list_batches(limit: int = 20, after: str | None = None, who: str = Depends(tenant)):
        found = page(store.batches(who), min(limit, 100), after, key=lambda b: b.id)
        found["data"] = [public(b) for b in found["data"]]
        return found

    @app.get("/v1/batches/{batch_id}")
    def get_batch(batch_id: str, who: str = Depends(tenant)):
        return public(_owned_batch(store, batch_id, who))

    @app.post("/v1/batches/{batch_id}/cancel")
    def cancel_batch(batch_id: str, who: str = Depends(tenant)):
        batch = _owned_batch(store, batch_id, who)
        if batch.status not in ACTIVE:
            raise ApiError(409, f"batch {batch_id} is {batch.status}: only an active batch can be cancelled")
        store.ask_cancel(batch_id)
        batch.cancel_requested = True
        return public(batch)

    return create
