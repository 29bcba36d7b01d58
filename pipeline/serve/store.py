"""The Batch API's files and batches: JSON objects in the configured object storage, under `<output>/_api/`.

  _api/files/<file id>.json        a file's metadata (tenant, name, purpose, bytes, where its content is)
  _api/files/<file id>.jsonl       an uploaded file's content (a job's result files stay where the job wrote them)
  _api/batches/<batch id>.json     a batch object (OpenAI's fields, plus its tenant and job)
  _api/batches/<batch id>.cancel   asked to cancel (the API writes it; the runner, the batch's one writer, acts)
  _api/inputs/<batch id>/input.jsonl   the batch's input, as its job reads it (removed when the batch ends)
  _api/active/<batch id>.json      the index of active batches (its tenant and creation time): what the
                                   runner lists each pass and what a tenant's cap counts, O(active batches)

Every write is whole and atomic (storage.write_bytes_atomic). Each object names its tenant; the API hands
an object only to a key of that tenant, and answers 404 to any other, as if it did not exist.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Iterator
from typing import Literal

import pyarrow.fs as pafs
from pydantic import BaseModel, ConfigDict, Field

from pipeline.status import ACTIVE_BATCH, BatchStatus, JobStatus
from pipeline.stores import storage
from pipeline.stores.paths import API, OutputPath
from pipeline.stores.staging import StagingArea

ACTIVE = ACTIVE_BATCH  # the batches the runner still works on
MAX_ATTEMPTS = 3  # runs of a batch's job that exit with an error before the batch is finalised with what it has


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class Batch(BaseModel):
    """A batch as the server keeps it: OpenAI's Batch object, then the server's own keys. The API creates it
    (`app.new_batch`), the runner moves it from status to status (the methods below: no I/O, each checks what
    it sets), the store saves it whole and parses it once as it reads it back: a status outside BatchStatus, or
    a value of the wrong type, is refused where it is set (`validate_assignment`), instead of a batch that never
    moves. It writes the keys it was given (`as_json`), and carries a key it does not know (`extra`), so an
    object written by another version reads back and is written again with the same keys."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: dict | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = RequestCounts()
    metadata: dict[str, str] | None = None
    model: str | None = None
    usage: dict | None = None
    # the server's own
    tenant: str  # whose batch: the API hands it to that tenant's keys only, and bills its job to it
    output_expires_after: int | None = None  # seconds the result files are kept after the batch ends
    cost_usd: float | None = None  # None: its job has not ended
    attempts: int = 0  # runs of its job started
    failed_runs: int = 0  # runs of its job that exited with an error
    # Asked to cancel: read from its `.cancel` marker as the store reads the batch (the API writes the marker,
    # never the batch), so never written with it.
    cancel_requested: bool = Field(False, exclude=True)
    airflow_run: str | None = None  # its DAG run's id, with `serve.airflow`
    airflow_conf: dict | None = None  # that run's params

    def move(self, status: BatchStatus, now: int, **values) -> None:
        """Set its status, the time it got there (`<status>_at`) and `values`."""
        self.status = status
        setattr(self, f"{status}_at", now)
        for name, value in values.items():
            setattr(self, name, value)

    def ending(self, now: int) -> Literal["cancelled", "expired"] | None:
        """How it ends before its job has: asked to cancel, or past its completion window (None: neither)."""
        return "cancelled" if self.cancel_requested else "expired" if now >= self.expires_at else None

    def stopped(self, now: int) -> None:
        """Its job was stopped (cancelled or expired, `ending`): finalised with what the job has."""
        if self.cancel_requested:
            self.cancelling_at = self.cancelling_at or now
        self.move("finalizing", now)

    def after_run(self, code: int, job: JobStatus | None, now: int) -> None:
        """A run of its job exited with `code` (its job's status now `job`): a failed run counts, and the batch
        is finalised unless another run may answer more: fewer than MAX_ATTEMPTS runs failed, and its job was
        not refused at a budget cap (it would be refused again). Runs that failed count, not launches: a server
        restarted mid-run launches its job again, and that is no fault of the job's."""
        self.failed_runs += code != 0
        if code == 0 or self.failed_runs >= MAX_ATTEMPTS or job == "refused":
            self.move("finalizing", now)

    def failed_for_good(self) -> bool:
        """Whether its job's runs failed MAX_ATTEMPTS times: it is finalised with what the job has."""
        return self.failed_runs >= MAX_ATTEMPTS

    def unanswered(self, status: BatchStatus, now: int, errors: dict | None = None) -> None:
        """It ends (`cancelled`, `expired` or `failed`) with no answer: every request failed."""
        total = self.request_counts.total
        self.request_counts = RequestCounts(total=total, completed=0, failed=total)
        self.move(status, now, **({"errors": errors} if errors else {}))

    def answered(self, status: BatchStatus, now: int, results: dict, cost_usd: float, **files: str) -> None:
        """It ends as `status` with what its job answered: `results`, its input's entry in the job's manifest
        (output/batch.py: request counts, usage, models), the job's cost, and its result `files` (file ids)."""
        counts, usage = results["request_counts"], results.get("usage") or {}
        prompt, cached, output = (usage.get(k, 0) for k in ("prompt_tokens", "cached_prompt_tokens", "output_tokens"))
        self.move(
            status,
            now,
            request_counts=RequestCounts(**{k: counts[k] for k in ("total", "completed", "failed")}),
            usage={  # OpenAI's `Batch.usage`: what its answers' `usage` report
                "input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": output,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + output,
            },
            model=",".join(results.get("models", [])) or None,
            cost_usd=cost_usd,
            **files,
        )

    def ended_at(self) -> int | None:
        """When it ended: completed, failed, cancelled or expired (None: it has not)."""
        return next((t for t in (self.completed_at, self.failed_at, self.cancelled_at, self.expired_at) if t), None)

    def as_json(self) -> dict:
        return self.model_dump(exclude_unset=True)


def new_id(prefix: str) -> str:
    """Unguessable, and ordered by creation: `created_at` is in whole seconds (as OpenAI's), so lists sorted by
    (created_at, id) keep the order objects were made in within a second too."""
    return f"{prefix}-{time.time_ns():016x}{secrets.token_hex(8)}"


class ApiStore:
    def __init__(self, out: storage.Location, clock=time.time):
        self.out = out
        self.creating = threading.Lock()
        self.clock = clock  # what "now" is for a file's `expires_at` (tests move it)

    def _path(self, folder: str, name: str | None = None) -> str:
        return OutputPath.api(folder, name).full(self.out)

    def _read(self, path: str) -> dict | None:
        try:
            return json.loads(storage.read_bytes(self.out, path))
        except storage.StorageError:
            return None

    def _write(self, path: str, value: dict) -> None:
        storage.write_bytes_atomic(self.out, path, json.dumps(value, sort_keys=True).encode())

    # -- files -----------------------------------------------------------------------------------------
    def add_file(self, tenant: str, filename: str, purpose: str, data: bytes, expires_after: int | None = None) -> dict:
        file_id = new_id("file")
        content = self._path("files", f"{file_id}.jsonl")
        storage.write_bytes_atomic(self.out, content, data)
        return self.register_file(tenant, filename, purpose, content, len(data), file_id, expires_after)

    def register_file(
        self,
        tenant: str,
        filename: str,
        purpose: str,
        content: str,
        size: int,
        file_id: str | None = None,
        expires_after: int | None = None,
    ) -> dict:
        """A file whose content is at `content` (a path under the output root); `expires_after` seconds after
        its creation it is deleted (None: never)."""
        now = int(self.clock())
        meta = {
            "id": file_id or new_id("file"),
            "object": "file",
            "bytes": size,
            "created_at": now,
            "expires_at": None if expires_after is None else now + expires_after,
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
            "tenant": tenant,
            "content": str(OutputPath.parse(content, self.out)),
        }
        self._write(self._path("files", f"{meta['id']}.json"), meta)
        return meta

    def file(self, tenant: str, file_id: str) -> dict | None:
        """The file, when `tenant` owns it (None: no such file, deleted, or another tenant's)."""
        if not _safe_id(file_id, "file"):
            return None
        meta = self._read(self._path("files", f"{file_id}.json"))
        if meta is None or meta["tenant"] != tenant or meta.get("deleted") or self.expired(meta):
            return None
        return meta

    def files(self, tenant: str, purpose: str | None = None) -> list[dict]:
        """The tenant's files (of `purpose`, if given) not deleted nor expired, oldest first."""
        found = [
            f
            for f in self._all("files")
            if f["tenant"] == tenant and not f.get("deleted") and purpose in (None, f["purpose"])
        ]
        return sorted((f for f in found if not self.expired(f)), key=lambda f: (f["created_at"], f["id"]))

    def expired(self, meta: dict) -> bool:
        return meta.get("expires_at") is not None and meta["expires_at"] <= self.clock()

    def delete_expired(self, tenant: str) -> int:
        """Delete the tenant's files past their `expires_at` (the API calls it as it lists or adds the tenant's
        files: a file past its time answers 404 from then on either way). Returns how many."""
        gone = [f for f in self._all("files") if f["tenant"] == tenant and not f.get("deleted") and self.expired(f)]
        for meta in gone:
            self.delete_file(meta)
        return len(gone)

    def content(self, meta: dict) -> bytes:
        return storage.read_bytes(self.out, self.out.join(meta["content"]))

    def all_files(self) -> list[dict]:
        """Every file not deleted, of any tenant (the runner's retention sweep)."""
        return [f for f in self._all("files") if not f.get("deleted")]

    def stream(self, meta: dict, chunk: int = 1 << 20) -> Iterator[bytes]:
        """The file's content in pieces of `chunk` bytes, read as they are sent (a large result file is never
        whole in memory)."""
        with self.out.fs.open_input_stream(self.out.join(meta["content"])) as f:
            while piece := f.read(chunk):
                yield piece

    def delete_file(self, meta: dict) -> None:
        """Its content removed (an upload's; a job's result files stay with the job), its metadata marked."""
        content = OutputPath.parse(meta["content"])
        if content.area == API and content.folder == "files":
            try:
                self.out.fs.delete_file(self.out.join(meta["content"]))
            except FileNotFoundError:
                pass
        self._write(self._path("files", f"{meta['id']}.json"), {**meta, "deleted": True})

    def remove_copies(self, meta: dict) -> None:
        """Remove what the ended batches made from a deleted file copied (their job's input and staged
        records): the runner removes them when a batch ends, so this finds some only in an output root from
        before it did. Reads the tenant's batches: for a client's delete, not for a sweep of many files."""
        for batch in self.batches(meta["tenant"]):
            if batch.input_file_id == meta["id"] and batch.status not in ACTIVE:
                self.remove_copies_of(batch.id)

    # -- batches ---------------------------------------------------------------------------------------
    def put_batch(self, batch: Batch) -> None:
        """Write the batch; an active one is in the index before its object exists, an ended one leaves it
        after its object says so (a crash in between leaves an entry the runner drops: never a lost batch). The
        copies of an ended batch's input are the runner's to remove (`remove_copies_of`)."""
        marker = self._path("active", f"{batch.id}.json")
        if batch.status in ACTIVE:
            self._write(marker, {"tenant": batch.tenant, "created_at": batch.created_at})
            self._write(self._path("batches", f"{batch.id}.json"), batch.as_json())
        else:
            self._write(self._path("batches", f"{batch.id}.json"), batch.as_json())
            self._forget_active(batch.id)

    def add_batch(self, batch: Batch, cap: int) -> bool:
        """Write a new batch unless its tenant has `cap` active ones already (False). One create at a time
        in this server, so that two creates cannot both pass the count."""
        with self.creating:
            if self.active_count(batch.tenant) >= cap:
                return False
            self.put_batch(batch)
            return True

    def _forget_active(self, batch_id: str) -> None:
        try:
            self.out.fs.delete_file(self._path("active", f"{batch_id}.json"))
        except FileNotFoundError:
            pass

    def active_batches(self) -> list[Batch]:
        """The active batches (any tenant), oldest first, read through the index: O(active), not O(batches)."""
        found = []
        for batch_id in self._names("active"):
            batch = self.batch(None, batch_id)
            if batch is not None and batch.status in ACTIVE:
                found.append(batch)
            elif batch is not None:  # ended, and its writer died before leaving the index
                self._forget_active(batch_id)
        return sorted(found, key=lambda b: (b.created_at, b.id))

    def active_count(self, tenant: str) -> int:
        """How many batches `tenant` has queued or running (an entry whose batch was never written counts,
        for at most the moment of a create that failed halfway)."""
        entries = (self._read(self._path("active", f"{name}.json")) for name in self._names("active"))
        return sum(1 for e in entries if e is not None and e["tenant"] == tenant)

    def index_active(self) -> int:
        """Rebuild the index from every batch object (a root written before the index existed, or an entry
        lost): once, when a runner starts. How many active batches it found."""
        active = [b for b in self._batches() if b.status in ACTIVE]
        indexed = set(self._names("active"))
        for batch in active:
            if batch.id not in indexed:
                self._write(
                    self._path("active", f"{batch.id}.json"),
                    {"tenant": batch.tenant, "created_at": batch.created_at},
                )
        return len(active)

    def batch(self, tenant: str | None, batch_id: str) -> Batch | None:
        """The batch, when `tenant` owns it (None: any tenant, for the runner), with whether it was asked to cancel."""
        if not _safe_id(batch_id, "batch"):
            return None
        raw = self._read(self._path("batches", f"{batch_id}.json"))
        if raw is None or (tenant is not None and raw["tenant"] != tenant):
            return None
        return Batch.model_validate(raw | {"cancel_requested": self.cancel_asked(batch_id)})

    def batches(self, tenant: str | None = None) -> list[Batch]:
        """Newest first, each active one with whether it was asked to cancel (at most a tenant's cap of active
        batches read so; an ended one's request no longer matters)."""
        found = [b for b in self._batches() if tenant is None or b.tenant == tenant]
        for b in found:
            if b.status in ACTIVE:
                b.cancel_requested = self.cancel_asked(b.id)
        return sorted(found, key=lambda b: (b.created_at, b.id), reverse=True)

    def ask_cancel(self, batch_id: str) -> None:
        storage.write_bytes_atomic(self.out, self._path("batches", f"{batch_id}.cancel"), b"")

    def cancel_asked(self, batch_id: str) -> bool:
        try:
            return self.out.fs.get_file_info(self._path("batches", f"{batch_id}.cancel")).type == pafs.FileType.File
        except OSError:
            return False

    def input_folder(self, batch_id: str) -> str:
        return self._path("inputs", batch_id)

    def input_file(self, batch_id: str) -> str:
        """The copy of a batch's input its job reads."""
        return self._path("inputs", f"{batch_id}/input.jsonl")

    def remove_copies_of(self, batch_id: str) -> None:
        """Delete what the server made from an ended batch's input: the copy its job read and the job's staged
        records (the client's upload stays until the client deletes it)."""
        folder = self.input_folder(batch_id)
        if self.out.fs.get_file_info(folder).type != pafs.FileType.NotFound:
            self.out.fs.delete_dir(folder)
        StagingArea(self.out, batch_id).remove()

    def _names(self, kind: str) -> list[str]:
        """The ids of the JSON objects under `_api/<kind>/`."""
        selector = pafs.FileSelector(self._path(kind), allow_not_found=True)
        infos = self.out.fs.get_file_info(selector)
        # A dot-file is a temporary one a write in flight (or a killed one) left.
        return [i.base_name[:-5] for i in infos if i.base_name.endswith(".json") and not i.base_name.startswith(".")]

    def _all(self, kind: str) -> list[dict]:
        return [v for v in (self._read(self._path(kind, f"{n}.json")) for n in self._names(kind)) if v is not None]

    def _batches(self) -> list[Batch]:
        """Every batch object, each parsed once as it is read."""
        return [Batch.model_validate(v) for v in self._all("batches")]


def _safe_id(value: str, prefix: str) -> bool:
    """An id this store made: never a path (`../`), so a client cannot name another object's file."""
    return value.startswith(f"{prefix}-") and value[len(prefix) + 1 :].isalnum() and len(value) < 64
