"""Ingest, read: list the input folder and parse every file into raw records, bad ones included.

Nothing is dropped here. A record that cannot be parsed still becomes a row, with `read_error`
set to a reason code, `read_detail` saying what was found and `raw_excerpt` holding the raw input,
so that the validate stage can quarantine it. Partitions are assigned here, deterministically from
the file path and the record's position, so a rerun over the same input sees the same partitions.

One hostile record never stops the reader: what Python's JSON parser or Arrow refuses (lone
surrogate escapes, numbers too long to convert, nesting deeper than the parsers recurse, invalid
UTF-8 inside Parquet) becomes that record's quarantine row. The checks for the rare cases run only
when a cheap test on the raw line says they may apply, so the common path costs what it did.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import zlib
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import InputConfig, StorageConfig
from pipeline.ingest.batch import RequestError, batch_format, parse_request
from pipeline.ingest.gunzip import gunzip
from pipeline.schema import RAW_RECORDS, REQUEST
from pipeline.stores import storage

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
TEXT_SUFFIXES = (".txt", ".md")
PARQUET_SUFFIXES = (".parquet",)
# Deeper objects or arrays are quarantined: later stages parse `metadata` again (route rules), with
# less of the recursion limit left than the reader had, and no real metadata is nested this deep.
MAX_NESTING = 100
FIELDS = ("id", "text", "tenant", "metadata")  # what the reader takes from a record; other fields are ignored
_ID_PEEK = re.compile(rb'"id"\s*:\s*"([^"\\]{1,256})"')
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # json.loads turns these into lone surrogates
_BOM = b"\xef\xbb\xbf"


def input_format(relative_path: str) -> str | None:
    name = relative_path.lower()
    for fmt, suffixes in (("jsonl", JSONL_SUFFIXES), ("text", TEXT_SUFFIXES), ("parquet", PARQUET_SUFFIXES)):
        if name.endswith(suffixes):
            return fmt
    return None


def partition_id(relative_path: str, chunk: int) -> str:
    """Stable across reruns and across other files being added: a hash of the path, plus the chunk."""
    return f"{hashlib.sha1(relative_path.encode()).hexdigest()[:10]}-{chunk:05d}"


# A pack of one-document files holds at most this many bytes of input, whatever records_per_partition
# allows: a planning process reads a whole partition's texts at once.
PACK_BYTES = 64 << 20


def packs(files: list[tuple[str, str, int]], records_per_partition: int, max_bytes: int = PACK_BYTES) -> list[list]:
    """The input files (input_files) in groups, each read as one partition or more: consecutive one-document
    files (.txt, .md: a record each) packed up to `records_per_partition` files and `max_bytes`, any other
    file alone (it is split into partitions by records as it is read). In job order. So a folder of
    20,000 one-document files is a few partitions, not 20,000 (each a set of staged files, work units,
    a commit and an Airflow task)."""
    groups: list[list] = []
    run: list = []
    run_bytes = 0
    for file in files:
        if not file[0].lower().endswith(TEXT_SUFFIXES):
            if run:
                groups.append(run)
                run, run_bytes = [], 0
            groups.append([file])
            continue
        if run and (len(run) >= records_per_partition or run_bytes + file[2] > max_bytes):
            groups.append(run)
            run, run_bytes = [], 0
        run.append(file)
        run_bytes += file[2]
    if run:
        groups.append(run)
    return groups


def pack_partition(paths: list[str]) -> str:
    """A pack's partition id: its first and last file and how many (the listing, in job order, decides
    the packs, so a rerun of the job packs the same files the same way). One file alone keeps its own."""
    if len(paths) == 1:
        return partition_id(paths[0], 0)
    return partition_id(f"{paths[0]}\0{paths[-1]}\0{len(paths)}", 0)


def _printable(value: str) -> str:
    """`value` with lone surrogates written as escapes, so that Arrow can store it."""
    return value.encode("utf-8", "backslashreplace").decode("utf-8")


def _excerpt_text(raw, limit: int) -> str | None:
    if raw is None:
        return None
    if isinstance(raw, bytes):
        return raw[: limit * 4].decode("utf-8", errors="replace")[:limit]
    if not isinstance(raw, str):
        try:
            raw = json.dumps(raw, default=str)
        except (ValueError, TypeError, RecursionError):
            raw = f"<{type(raw).__name__}>"
    return _printable(raw[: limit * 4])[:limit]


class _Rows:
    """Column builder for RAW_RECORDS."""

    def __init__(
        self, relative_path: str, config: InputConfig, by_partition: bool = False, partition: str | None = None
    ):
        self.file, self.config, self.by_partition = relative_path, config, by_partition
        self.partition = partition  # a pack's: every row of this file goes there
        self.ready: list[pa.Table] = []  # whole partitions read, not yet handed on (by_partition)
        self.cols: dict[str, list] = {name: [] for name in RAW_RECORDS.names}
        self.note: str | None = None  # what the manifest should say about this file, if anything
        self._partitions: dict[int, str] = {}
        self.count = 0  # records added, handed on or not
        # "records", or a batch format ("openai", "anthropic"): forced by input.format, else the first object's
        self.format = None if config.format == "auto" else config.format

    def add(
        self,
        position: int,
        line: int | None,
        *,
        id=None,
        text=None,
        tenant=None,
        metadata=None,
        request=None,
        error=None,
        detail=None,
        raw=None,
    ) -> None:
        chunk = position // self.config.records_per_partition  # positions only grow: a chunk is never reopened
        if chunk not in self._partitions:
            if self.by_partition:
                self.flush()  # a new partition begins: the last one is whole
            self._partitions[chunk] = self.partition or partition_id(self.file, chunk)
        self.count += 1
        c = self.cols
        c["id"].append(id)
        c["text"].append(text)
        c["tenant"].append(tenant or self.config.default_tenant)
        c["metadata"].append(metadata)
        c["request"].append(request)
        c["file"].append(self.file)
        c["line"].append(line)
        c["partition"].append(self._partitions[chunk])
        c["read_error"].append(error)
        c["read_detail"].append(detail if error else None)
        c["raw_excerpt"].append(_excerpt_text(raw, self.config.excerpt_chars) if error else None)

    def __len__(self) -> int:
        return self.count

    def flush(self) -> None:
        """Move the rows held, if any, to `ready` as one partition's table."""
        if self.cols["id"]:
            table, self.cols = self.table(), {name: [] for name in RAW_RECORDS.names}
            self.ready.append(table)

    def take(self) -> list[pa.Table]:
        """The partitions read whole since the last take."""
        ready, self.ready = self.ready, []
        return ready

    def table(self) -> pa.Table:
        try:
            return pa.table(self.cols, schema=RAW_RECORDS)
        except (UnicodeEncodeError, OverflowError, pa.ArrowException):
            # The net under the per-record checks: a value Arrow refuses makes its record a quarantine
            # row instead of failing the file (and the job).
            self._quarantine_unstorable()
            return pa.table(self.cols, schema=RAW_RECORDS)

    def _quarantine_unstorable(self) -> None:
        strings = [n for n in RAW_RECORDS.names if RAW_RECORDS.field(n).type in (pa.string(), REQUEST)]
        for i in range(len(self.cols["id"])):
            bad = next(((n, p) for n in strings if (p := _unstorable(self.cols[n][i], n))), None)
            if not bad:
                continue
            name, (kind, where) = bad
            if kind == "integer":
                self.cols["read_error"][i] = "invalid_request"
                self.cols["read_detail"][i] = f"`{where}` is an integer out of range"
            else:
                self.cols["read_error"][i] = "invalid_unicode"
                self.cols["read_detail"][i] = f"`{name}` is not valid Unicode text"
            for name in ("id", "text", "metadata", "request"):
                self.cols[name][i] = None
            for name in ("tenant", "file", "partition", "raw_excerpt"):
                value = self.cols[name][i]
                self.cols[name][i] = _printable(value) if isinstance(value, str) else None
            self.cols["tenant"][i] = self.cols["tenant"][i] or self.config.default_tenant


def _unstorable(value, where: str) -> tuple[str, str] | None:
    """What of `value` Arrow cannot hold, if anything: ("integer", the field) for an integer past int64,
    ("text", the field) for text that is not valid Unicode."""
    if value is None or isinstance(value, (bool, float)):
        return None
    if isinstance(value, int):
        return None if -(2**63) <= value < 2**63 else ("integer", where)
    if isinstance(value, dict):  # a batch request (schema.REQUEST)
        return next((p for k, v in value.items() if (p := _unstorable(v, k))), None)
    if isinstance(value, list):
        return next((p for v in value if (p := _unstorable(v, where))), None)
    if not isinstance(value, str):
        return ("text", where)
    if value.isascii():
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return ("text", where)
    return None


def _nesting(value) -> int:
    """How deeply `value` nests lists and dicts (iteratively: it must not recurse itself)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = item.values()
        elif not isinstance(item, (list, tuple)):
            continue
        deepest = max(deepest, depth)
        if deepest > MAX_NESTING:
            break
        stack.extend((child, depth + 1) for child in item)
    return deepest


def _metadata_json(value) -> str | None:
    if value is None:
        return None
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)


def _name_value(value, error: str) -> tuple[str | None, str | None]:
    """(`id` or `tenant` as a string, error): strings, and integers written as decimal strings.
    Anything else is refused rather than stringified: `{"a": 1}` or `false` names no record or tenant."""
    if value is None or value == "":
        return None, None  # validate reports missing_id; a missing tenant is the default one
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return None, error
    return str(value), None


def _unicode_problem(fields: dict[str, str | dict | None]) -> str | None:
    """Detail naming the first field that holds a lone surrogate (which UTF-8 cannot encode), or None."""
    for name, value in fields.items():
        if isinstance(value, dict):  # a batch request: its strings, as one text
            value = json.dumps(value, ensure_ascii=False)
        if value is None or value.isascii():
            continue
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return f"`{name}` holds a lone surrogate (U+{ord(value[e.start]):04X}), which is not valid Unicode"
    return None


def _add_object(rows: _Rows, position: int, line: int | None, obj: dict, raw, check_unicode: bool = False) -> None:
    id_, error = _name_value(obj.get("id"), "invalid_id")
    detail = None
    text = obj.get("text")
    if error is None and text is not None and not isinstance(text, str):
        error = "non_string_text"
    tenant, tenant_error = _name_value(obj.get("tenant"), "invalid_tenant")
    if error is None and tenant_error:
        error, detail = tenant_error, f"`tenant` is {type(obj.get('tenant')).__name__}, not a string"
    try:
        metadata = _metadata_json(obj.get("metadata"))
    except RecursionError:
        metadata = ""
    # Counting brackets costs little; only metadata with many of them has its depth measured.
    if metadata == "" or (
        metadata and metadata.count("[") + metadata.count("{") > MAX_NESTING and _nesting(obj["metadata"]) > MAX_NESTING
    ):
        metadata = None
        error, detail = error or "too_deeply_nested", detail or f"`metadata` is nested deeper than {MAX_NESTING} levels"
    if error is None and check_unicode:
        detail = _unicode_problem({"id": id_, "text": text, "tenant": tenant, "metadata": metadata})
        if detail:
            error = "invalid_unicode"
            id_ = id_ if _unstorable(id_, "id") is None else None
            tenant = tenant if _unstorable(tenant, "tenant") is None else None
    if error:
        rows.add(position, line, id=id_, tenant=tenant, error=error, detail=detail, raw=raw)
    else:
        rows.add(position, line, id=id_, text=text, tenant=tenant, metadata=metadata)


def _add_request(rows: _Rows, position: int, line: int, obj: dict, raw, check_unicode: bool) -> None:
    """One line of a batch file (ingest/batch.py): a record whose `request` holds what it asks."""
    custom_id = obj.get("custom_id")
    custom_id = custom_id if isinstance(custom_id, str) else None
    if _nesting(obj) > MAX_NESTING:  # later stages parse the request again, with less recursion left
        detail = f"the request is nested deeper than {MAX_NESTING} levels"
        rows.add(position, line, id=custom_id, error="too_deeply_nested", detail=detail, raw=raw)
        return
    try:
        record = parse_request(obj, rows.format)
    except RequestError as e:
        rows.add(position, line, id=custom_id, error=e.reason, detail=e.detail, raw=raw)
        return
    except (TypeError, ValueError, AttributeError, OverflowError, RecursionError) as e:
        # The net under parse_request's own checks: a value of a shape none of them foresaw.
        detail = f"a field of an unexpected type or size ({type(e).__name__})"
        rows.add(position, line, id=custom_id, error="invalid_request", detail=detail, raw=raw)
        return
    if check_unicode:
        detail = _unicode_problem({k: record[k] for k in ("id", "text", "tenant", "request")})
        if detail:
            rows.add(position, line, error="invalid_unicode", detail=detail, raw=raw)
            return
    if rows.config.request_tenant == "default":  # the caller's tenant, whatever the request says
        record["tenant"] = None
    rows.add(position, line, **record)


def _parse_line(line: bytes) -> tuple[object, str | None, str | None]:
    """(the parsed value, error, detail)."""
    try:
        value = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as e:
        return None, "invalid_utf8", f"byte {e.start} of the line is not UTF-8"
    except json.JSONDecodeError as e:
        return None, "malformed_json", e.msg + f" at column {e.colno}"
    except ValueError:  # Python refuses to convert integers of more than sys.get_int_max_str_digits()
        return None, "number_too_long", f"an integer longer than {sys.get_int_max_str_digits()} digits"
    except RecursionError:
        return None, "too_deeply_nested", "nested deeper than the JSON parser recurses"
    return value, None, None


def _lines(data: bytes, start: int):
    """data[start:].split(b"\n"), one line at a time: no second copy of the file."""
    while (end := data.find(b"\n", start)) >= 0:
        yield data[start:end]
        start = end + 1
    yield data[start:]


def _read_jsonl(rows: _Rows, data: bytes, gzipped: bool) -> Iterator[pa.Table]:
    damage = None
    if gzipped:
        data, damage = gunzip(data)
    start = 3 if data.startswith(_BOM) else 0  # a BOM some editors write: not part of the first record
    max_line = rows.config.max_document_bytes * 2 + 65536  # room for JSON escapes and other fields
    position = number = 0
    # Lines end at \n only (a \r before it is dropped): a bare \r inside an object is JSON whitespace,
    # not a line end (bytes.splitlines would split there).
    for number, line in enumerate(_lines(data, start), start=1):
        if line.endswith(b"\r"):
            line = line[:-1]
        if not line.strip():
            continue  # blank lines are not records
        if len(line) > max_line:
            peek = _ID_PEEK.search(line[:1024])
            rows.add(
                position,
                number,
                id=peek.group(1).decode("utf-8", "replace") if peek else None,
                error="too_large",
                raw=line,
            )
        else:
            obj, error, detail = _parse_line(line)
            if error is None and not isinstance(obj, dict):
                error = "not_an_object"
            if error:
                rows.add(position, number, error=error, detail=detail, raw=line)
            else:
                if rows.format is None:  # the file's first object says what the file holds
                    rows.format = batch_format(obj) or "records"
                if rows.format == "records":
                    _add_object(rows, position, number, obj, line, _SURROGATE_ESCAPE.search(line) is not None)
                else:
                    _add_request(rows, position, number, obj, line, _SURROGATE_ESCAPE.search(line) is not None)
        position += 1
        yield from rows.take()
    if damage is not None:
        tail, what = damage
        # `data` ends with a line end here, so `number` is the line the damage starts in.
        rows.add(position, number, error="unreadable_file", detail=what, raw=tail or what)


def _parquet_rows(table: pa.Table, start: int, stop: int) -> list[tuple[int, dict | None, str | None, str | None]]:
    """(position, row or None, error, detail) for rows start..stop: a batch Arrow cannot convert is
    converted row by row, so that a bad value costs one record."""
    try:
        return [(start + i, row, None, None) for i, row in enumerate(table.slice(start, stop - start).to_pylist())]
    except (ValueError, OverflowError, RecursionError, pa.ArrowException):
        pass
    out = []
    for position in range(start, stop):
        try:
            out.append((position, table.slice(position, 1).to_pylist()[0], None, None))
        except UnicodeDecodeError as e:
            out.append((position, None, "invalid_utf8", f"a string value is not UTF-8 ({e.reason})"))
        except RecursionError:
            out.append((position, None, "too_deeply_nested", "nested deeper than the reader recurses"))
        except (ValueError, OverflowError, pa.ArrowException) as e:
            out.append((position, None, "unreadable_value", f"{type(e).__name__}: {e}"[:300]))
    return out


def _read_parquet(rows: _Rows, data: bytes) -> Iterator[pa.Table]:
    parquet = pq.ParquetFile(pa.BufferReader(data))
    names = parquet.schema_arrow.names
    table = parquet.read(columns=[n for n in FIELDS if n in names])
    for start in range(0, table.num_rows, 4096):
        for position, row, error, detail in _parquet_rows(table, start, min(start + 4096, table.num_rows)):
            if error:
                rows.add(position, position + 1, error=error, detail=detail, raw=row or detail)
            else:
                # to_pylist keeps each value's own type, so a non-string `text` is reported row by row.
                _add_object(rows, position, position + 1, row, row)
        yield from rows.take()


def _read_text(rows: _Rows, data: bytes) -> None:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        rows.add(0, None, id=rows.file, error="invalid_utf8", detail=f"byte {e.start} is not UTF-8", raw=data)
        return
    rows.add(0, None, id=rows.file, text=text)


class FileReader:
    """One input file's records, read a partition at a time (`partitions()`: planning keys a large file
    without holding its records at once) or whole (`table()`). A file that cannot be read at all is one
    `unreadable_file` row; `note` says, once read, why a file gave no record (for the manifest)."""

    def __init__(
        self, root: storage.Location, relative_path: str, path: str, config: InputConfig, partition: str | None = None
    ):
        """`partition`: the pack's this one-document file is read into (packs), instead of its own."""
        self.root, self.relative_path, self.path, self.config = root, relative_path, path, config
        self.partition = partition
        self.note: str | None = None
        self.format: str | None = None  # once read: "records", "openai" or "anthropic" (None: no object read)

    def partitions(self) -> Iterator[pa.Table]:
        """Each partition's records as soon as it is read whole, in order. An error of the code that takes
        them is raised there, never blamed on the file."""
        rows = _Rows(self.relative_path, self.config, by_partition=True, partition=self.partition)
        yield from _read_rows(rows, self.root, self.relative_path, self.path)
        rows.flush()
        yield from rows.take()
        self.note, self.format = rows.note, rows.format

    def table(self) -> pa.Table:
        """All the file's records in one table."""
        rows = _Rows(self.relative_path, self.config, partition=self.partition)
        for _ in _read_rows(rows, self.root, self.relative_path, self.path):
            pass
        self.note, self.format = rows.note, rows.format
        return rows.table()


def _read_rows(rows: _Rows, root: storage.Location, relative_path: str, path: str) -> Iterator[pa.Table]:
    """Parse the file into `rows`, yielding each partition read whole (only when `rows` is by_partition)."""
    fmt = input_format(relative_path)
    try:
        try:
            data = storage.read_bytes(root, path)
        except storage.StorageError as e:
            if root.scheme:
                raise  # an object store failing is an outage to retry, not a property of the record
            raise OSError(str(e)) from None
        if fmt == "jsonl":
            yield from _read_jsonl(rows, data, gzipped=relative_path.lower().endswith(".gz"))
        elif fmt == "parquet":
            yield from _read_parquet(rows, data)
        else:
            _read_text(rows, data)
    except (OSError, EOFError, zlib.error, pa.ArrowException, UnicodeDecodeError) as e:
        # Records parsed before the failure are kept; the rest of the file is one quarantine row. (A Parquet
        # footer naming a column in bytes that are not UTF-8 fails as UnicodeDecodeError.)
        what = f"{type(e).__name__}: {e}"
        rows.add(len(rows), None, error="unreadable_file", detail=what[:1000], raw=what)
    if not len(rows):  # e.g. an empty .gz, which is not even a gzip file: say so rather than read nothing
        rows.note = f"{relative_path}: " + ("empty file (0 bytes), no records" if not data else "no records")


def read_records(
    uri: str,
    config: InputConfig,
    storage_config: StorageConfig | None = None,
    files: list[tuple[str, str, int]] | None = None,
) -> tuple[pa.Table, list[str]]:
    """Every record under `uri` (or in `files`, as `input_files` lists them), and notes on files that
    gave none: skipped for their extension, or empty."""
    root = storage.resolve(uri, storage_config)
    notes: list[str] = []
    if files is None:
        files, notes = input_files(root)
    tables = []
    for group in packs(files, config.records_per_partition):
        pack = pack_partition([f[0] for f in group]) if len(group) > 1 else None
        for relative_path, path, *_ in group:
            reader = FileReader(root, relative_path, path, config, partition=pack)
            tables.append(reader.table())
            if reader.note:
                notes.append(reader.note)
    if not tables:
        return RAW_RECORDS.empty_table(), notes
    return pa.concat_tables(tables), notes


def input_files(root: storage.Location) -> tuple[list[tuple[str, str, int]], list[str]]:
    """(relative, full path, bytes) of the input files under `root`, in job order, and a note per file
    skipped (for its extension, or not read at all: storage.list_files)."""
    files, notes = [], []
    for relative_path, path, size in storage.list_files(root, notes):
        if input_format(relative_path) is None:
            notes.append(f"{relative_path}: skipped, not .jsonl, .jsonl.gz, .parquet, .txt or .md")
        else:
            files.append((relative_path, path, size))
    return files, notes
