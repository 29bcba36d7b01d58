"""Ingest, read: list the input folder and parse every file into raw records, bad ones included.

Nothing is dropped here. A record that cannot be parsed still becomes a row, with `read_error`
set to a reason code and `raw_excerpt` holding the raw input, so that the validate stage can
quarantine it. Partitions are assigned here, deterministically from the file path and the
record's position, so a rerun over the same input sees the same partitions.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import zlib
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import InputConfig, StorageConfig
from pipeline.schema import RAW_RECORDS
from pipeline.stores import storage

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
TEXT_SUFFIXES = (".txt", ".md")
PARQUET_SUFFIXES = (".parquet",)
_ID_PEEK = re.compile(rb'"id"\s*:\s*"([^"\\]{1,256})"')


def input_format(relative_path: str) -> str | None:
    name = relative_path.lower()
    for fmt, suffixes in (("jsonl", JSONL_SUFFIXES), ("text", TEXT_SUFFIXES), ("parquet", PARQUET_SUFFIXES)):
        if name.endswith(suffixes):
            return fmt
    return None


def partition_id(relative_path: str, chunk: int) -> str:
    """Stable across reruns and across other files being added: a hash of the path, plus the chunk."""
    return f"{hashlib.sha1(relative_path.encode()).hexdigest()[:10]}-{chunk:05d}"


class _Rows:
    """Column builder for RAW_RECORDS."""

    def __init__(self, relative_path: str, config: InputConfig):
        self.file, self.config = relative_path, config
        self.cols: dict[str, list] = {name: [] for name in RAW_RECORDS.names}

    def add(self, position: int, line: int | None, *, id=None, text=None, tenant=None, metadata=None,
            error=None, raw: bytes | str | None = None) -> None:
        c = self.cols
        c["id"].append(id)
        c["text"].append(text)
        c["tenant"].append(tenant or self.config.default_tenant)
        c["metadata"].append(metadata)
        c["file"].append(self.file)
        c["line"].append(line)
        c["partition"].append(partition_id(self.file, position // self.config.records_per_partition))
        c["read_error"].append(error)
        if isinstance(raw, bytes):
            raw = raw[: self.config.excerpt_chars * 4].decode("utf-8", errors="replace")
        c["raw_excerpt"].append(raw[: self.config.excerpt_chars] if raw is not None and error else None)

    def table(self) -> pa.Table:
        return pa.table(self.cols, schema=RAW_RECORDS)


def _metadata_json(value) -> str | None:
    if value is None:
        return None
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)


def _id_value(value) -> tuple[str | None, str | None]:
    """(id as string, error) — integers are accepted and written as decimal strings."""
    if value is None or value == "":
        return None, None  # validate reports missing_id
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return None, "invalid_id"
    return str(value), None


def _jsonl_lines(data: bytes, gzipped: bool) -> Iterator[bytes]:
    if gzipped:
        data = gzip.decompress(data)
    yield from data.splitlines()


def _read_jsonl(rows: _Rows, data: bytes, gzipped: bool) -> None:
    max_line = rows.config.max_document_bytes * 2 + 65536  # room for JSON escapes and other fields
    position = 0
    for number, line in enumerate(_jsonl_lines(data, gzipped), start=1):
        if not line.strip():
            continue  # blank lines are not records
        if len(line) > max_line:
            peek = _ID_PEEK.search(line[:1024])
            rows.add(position, number, id=peek.group(1).decode("utf-8", "replace") if peek else None,
                     error="too_large", raw=line)
            position += 1
            continue
        try:
            obj = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError:
            rows.add(position, number, error="invalid_utf8", raw=line)
        except json.JSONDecodeError:
            rows.add(position, number, error="malformed_json", raw=line)
        else:
            if not isinstance(obj, dict):
                rows.add(position, number, error="not_an_object", raw=line)
            else:
                _add_object(rows, position, number, obj, line)
        position += 1


def _add_object(rows: _Rows, position: int, line: int | None, obj: dict, raw) -> None:
    id_, error = _id_value(obj.get("id"))
    text = obj.get("text")
    if error is None and text is not None and not isinstance(text, str):
        error = "non_string_text"
    tenant = obj.get("tenant")
    rows.add(position, line, id=id_, text=text if error is None else None,
             tenant=str(tenant) if tenant not in (None, "") else None,
             metadata=_metadata_json(obj.get("metadata")), error=error, raw=raw)


def _read_parquet(rows: _Rows, data: bytes) -> None:
    table = pq.read_table(pa.BufferReader(data))
    # to_pylist keeps each value's own type, so a non-string `text` is reported row by row.
    for position, row in enumerate(table.to_pylist()):
        _add_object(rows, position, position + 1, row, json.dumps(row, default=str))


def _read_text(rows: _Rows, data: bytes) -> None:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        rows.add(0, None, id=rows.file, error="invalid_utf8", raw=data)
        return
    rows.add(0, None, id=rows.file, text=text)


def read_file(root: storage.Location, relative_path: str, path: str, config: InputConfig) -> pa.Table:
    """All records of one input file; a file that cannot be read at all is one `unreadable_file` row."""
    fmt = input_format(relative_path)
    rows = _Rows(relative_path, config)
    try:
        try:
            data = storage.read_bytes(root, path)
        except storage.StorageError as e:
            if root.scheme:
                raise  # an object store failing is an outage to retry, not a property of the record
            raise OSError(str(e)) from None
        if fmt == "jsonl":
            _read_jsonl(rows, data, gzipped=relative_path.lower().endswith(".gz"))
        elif fmt == "parquet":
            _read_parquet(rows, data)
        else:
            _read_text(rows, data)
    except (OSError, EOFError, zlib.error, pa.ArrowException) as e:
        # Records parsed before the failure (e.g. a truncated .gz) are kept; the rest of the file is
        # one quarantine row naming the error.
        rows.add(len(rows.cols["id"]), None, error="unreadable_file", raw=f"{type(e).__name__}: {e}")
    return rows.table()


def read_records(uri: str, config: InputConfig, storage_config: StorageConfig | None = None) -> tuple[pa.Table, list[str]]:
    """Every record under `uri`, and the relative paths of files skipped for their extension."""
    root = storage.resolve(uri, storage_config)
    tables, skipped = [], []
    for relative_path, path, _size in storage.list_files(root):
        if input_format(relative_path) is None:
            skipped.append(relative_path)
            continue
        tables.append(read_file(root, relative_path, path, config))
    if not tables:
        return RAW_RECORDS.empty_table(), skipped
    return pa.concat_tables(tables), skipped
