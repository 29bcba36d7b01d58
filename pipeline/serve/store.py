"""The Batch API's files and batches: JSON objects in the configured object storage, under `<output>/_api/`.

  _api/files/<file id>.json        a file's metadata (tenant, name, purpose, bytes, where its content is)
  _api/files/<file id>.jsonl       an uploaded file's content (a job's result files stay where the job wrote them)
  _api/batches/<batch id>.json     a batch object (OpenAI's fields, plus its tenant and job)
  _api/batches/<batch id>.cancel   asked to cancel (the API writes it; the runner, the batch's one writer, acts)
  _api/inputs/<batch id>/input.jsonl   the batch's input, as its job reads it

Every write is whole and atomic (storage.write_bytes_atomic). Each object names its tenant; the API hands
an object only to a key of that tenant, and answers 404 to any other, as if it did not exist.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator

import pyarrow.fs as pafs

from pipeline.output.commit import relative
from pipeline.stores import storage


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


class ApiStore:
    def __init__(self, out: storage.Location, clock=time.time):
        self.out = out
        self.clock = clock  # what "now" is for a file's `expires_at` (tests move it)

    def _path(self, *parts: str) -> str:
        return self.out.join("_api", *parts)

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
            "content": relative(self.out, content),
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

    def stream(self, meta: dict, chunk: int = 1 << 20) -> Iterator[bytes]:
        """The file's content in pieces of `chunk` bytes, read as they are sent (a large result file is never
        whole in memory)."""
        with self.out.fs.open_input_stream(self.out.join(meta["content"])) as f:
            while piece := f.read(chunk):
                yield piece

    def delete_file(self, meta: dict) -> None:
        """Its content removed (an upload's; a job's result files stay with the job), its metadata marked."""
        if meta["content"].startswith("_api/files/"):
            try:
                self.out.fs.delete_file(self.out.join(meta["content"]))
            except FileNotFoundError:
                pass
        self._write(self._path("files", f"{meta['id']}.json"), {**meta, "deleted": True})

    # -- batches ---------------------------------------------------------------------------------------
    def put_batch(self, batch: dict) -> None:
        self._write(self._path("batches", f"{batch['id']}.json"), batch)

    def batch(self, tenant: str | None, batch_id: str) -> dict | None:
        """The batch, when `tenant` owns it (None: any tenant, for the runner)."""
        if not _safe_id(batch_id, "batch"):
            return None
        batch = self._read(self._path("batches", f"{batch_id}.json"))
        return batch if batch is not None and (tenant is None or batch["tenant"] == tenant) else None

    def batches(self, tenant: str | None = None) -> list[dict]:
        """Newest first."""
        found = [b for b in self._all("batches") if tenant is None or b["tenant"] == tenant]
        return sorted(found, key=lambda b: (b["created_at"], b["id"]), reverse=True)

    def ask_cancel(self, batch_id: str) -> None:
        storage.write_bytes_atomic(self.out, self._path("batches", f"{batch_id}.cancel"), b"")

    def cancel_asked(self, batch_id: str) -> bool:
        try:
            return self.out.fs.get_file_info(self._path("batches", f"{batch_id}.cancel")).type == pafs.FileType.File
        except OSError:
            return False

    def input_folder(self, batch_id: str) -> str:
        return self._path("inputs", batch_id)

    def _all(self, kind: str) -> list[dict]:
        selector = pafs.FileSelector(self._path(kind), allow_not_found=True)
        infos = self.out.fs.get_file_info(selector)
        # A dot-file is a temporary one a write in flight (or a killed one) left.
        names = [i.path for i in infos if i.path.endswith(".json") and not i.base_name.startswith(".")]
        return [v for v in (self._read(p) for p in names) if v is not None]


def _safe_id(value: str, prefix: str) -> bool:
    """An id this store made: never a path (`../`), so a client cannot name another object's file."""
    return value.startswith(f"{prefix}-") and value[len(prefix) + 1 :].isalnum() and len(value) < 64
