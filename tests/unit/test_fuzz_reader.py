"""Property-based fuzz of read + validate with hostile input files (Hypothesis).

Inputs: random bytes under every supported extension; valid JSONL (plain and gzipped) built from
hostile values (lone surrogates, NULs, BOMs, RTL marks, line separators, long tenants, non-string
fields, deep metadata) and then mutated byte-wise (flips, cuts, insertions of huge numbers, deep
brackets, bare CRs, BOMs, invalid UTF-8); Parquet files with wrong column types (`id` as a list,
`text` as binary, invalid UTF-8 in string columns), mutated too.

Properties, for every input:
  * read_records + validate_records never raise;
  * every record read ends in exactly one valid-or-quarantine row (by (file, line), no row in both);
  * every valid record round-trips: its id, text and tenant equal what an independent parse of that
    record's line (or Parquet row, or text file) gives, byte for byte;
  * everything either side holds can be stored: Parquet writes both tables, ids and tenants fit the
    state catalog, and every quarantine reason is a documented one.

The suite runs a bounded number of examples (deterministic, seconds). `make fuzz` runs the long
one: TOKENMILL_FUZZ_EXAMPLES examples per test (random seeds), e.g. 2,500 x 5 tests.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import tempfile
import zlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pipeline.config import InputConfig
from pipeline.ingest.read import FIELDS, read_records
from pipeline.ingest.validate import TENANT_MAX_CHARS, validate_records
from pipeline.schema import REASONS

FUZZ_EXAMPLES = int(os.environ.get("TOKENMILL_FUZZ_EXAMPLES", "0"))
settings.register_profile(
    "tokenmill-suite",
    max_examples=60,
    deadline=None,
    database=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "tokenmill-fuzz",
    max_examples=max(FUZZ_EXAMPLES, 1),
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
PROFILE = settings.get_profile("tokenmill-fuzz" if FUZZ_EXAMPLES else "tokenmill-suite")
CONFIG = InputConfig(max_document_bytes=4000, records_per_partition=3, excerpt_chars=40, default_tenant="house")

# Characters that have broken readers: lone surrogates (two of them a pair that JSON joins), NUL, BOM,
# RTL/LTR marks and overrides, line and paragraph separators, CR, NEL, form feed, quotes, backslash.
HOSTILE = [
    "\ud800",
    "\udfff",
    "\udbff",
    "\udc00",
    "\x00",
    "\ufeff",
    "\u200f",
    "\u202e",
    "\u2028",
    "\u2029",
    "\r",
    "\n",
    "\x85",
    "\x0c",
    "\x1e",
    '"',
    "\\",
    "é",
    "\U0001f600",
    " ",
]
SNIPPETS = [
    b"1" * 5000,
    b"-" + b"9" * 4400,
    b"[" * 2000,
    b"{" * 300,
    b"[" * 150 + b"]" * 150,
    b"\\ud800",
    b"\\u0000",
    b"\xef\xbb\xbf",
    b"\r",
    b"\n",
    b"\r\n",
    b"\x00",
    b"\xff",
    b"\xed\xa0\x80",
    b'"',
    b"}",
    b'{"id": "x", "text": "y"}\n',
    b"1e99999",
    b"NaN",
]

# Dense in hostile characters: pieces of them between short runs of any characters.
hostile_text = st.lists(st.one_of(st.sampled_from(HOSTILE), st.text(max_size=4)), max_size=8).map("".join)
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), hostile_text)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(hostile_text, inner, max_size=3)),
    max_leaves=8,
)


def nested(depth: int, leaf=1):
    for _ in range(depth):
        leaf = [leaf]
    return leaf


@st.composite
def records(draw) -> dict:
    """Mostly a valid record with one or two hostile fields, so that the validators are exercised too."""
    rec = {
        "id": draw(st.one_of(st.integers(), st.text(min_size=1, max_size=8), hostile_text)),
        "text": draw(st.one_of(st.text(min_size=1, max_size=20), hostile_text)),
    }
    if draw(st.booleans()):
        rec["tenant"] = draw(st.one_of(st.text(max_size=8), hostile_text))
    if draw(st.booleans()):
        rec["metadata"] = draw(json_values)
    for _ in range(draw(st.integers(0, 2))):
        field = draw(st.sampled_from(["id", "text", "tenant", "metadata"]))
        if draw(st.integers(0, 5)) == 0:
            rec.pop(field, None)
        elif field == "tenant":
            rec[field] = draw(
                st.one_of(
                    hostile_text,
                    scalars,
                    json_values,
                    st.sampled_from(["t" * (TENANT_MAX_CHARS + 1), "é" * TENANT_MAX_CHARS, "a\x00b", "\ud800", ""]),
                )
            )
        elif field == "metadata":
            rec[field] = draw(st.one_of(json_values, st.integers(90, 130).map(nested)))
        else:
            rec[field] = draw(
                st.one_of(
                    hostile_text, scalars, json_values, st.sampled_from(["a\x00b", "x\ud800", " ", "", "x" * 5000])
                )
            )
    return rec


def jsonl_bytes(recs: list[dict], ascii_only: bool, line_end: bytes) -> bytes:
    lines = []
    for rec in recs:
        text = json.dumps(rec, ensure_ascii=ascii_only)
        # Without ensure_ascii a lone surrogate is written as its (invalid) UTF-8 bytes.
        lines.append(text.encode("utf-8", "surrogatepass"))
    return b"".join(line + line_end for line in lines)


@st.composite
def mutated(draw, data: bytes) -> bytes:
    for _ in range(draw(st.integers(0, 4))):
        at = draw(st.integers(0, len(data)))
        op = draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        if op == "flip" and data:
            at = min(at, len(data) - 1)
            data = data[:at] + bytes([data[at] ^ draw(st.integers(1, 255))]) + data[at + 1 :]
        elif op == "insert":
            data = data[:at] + draw(st.sampled_from(SNIPPETS)) + data[at:]
        elif op == "delete":
            data = data[:at] + data[at + draw(st.integers(1, 64)) :]
        elif op == "truncate":
            data = data[:at]
    return data


@st.composite
def jsonl_files(draw) -> tuple[str, bytes]:
    recs = draw(st.lists(records(), max_size=8))
    data = jsonl_bytes(recs, draw(st.booleans()), draw(st.sampled_from([b"\n", b"\r\n"])))
    if draw(st.booleans()):
        data = b"\xef\xbb\xbf" + data
    gzipped = draw(st.booleans())
    if draw(st.booleans()):  # mutate the text, before compressing it
        data = draw(mutated(data))
    if gzipped:
        data = gzip.compress(data)
        if draw(st.booleans()):  # and/or damage the compressed bytes
            data = draw(mutated(data))
    return ("f.jsonl.gz" if gzipped else "f.jsonl"), data


def _column(kind: str, n: int, draw) -> pa.Array:
    strings = draw(st.lists(st.one_of(st.none(), hostile_text), min_size=n, max_size=n))
    if kind == "string":  # lone surrogates become invalid UTF-8 bytes inside a string column
        raw = [None if s is None else s.encode("utf-8", "surrogatepass") for s in strings]
        return pa.array(raw, pa.binary()).view(pa.string())
    if kind == "binary":
        return pa.array([None if s is None else s.encode("utf-8", "surrogatepass") for s in strings], pa.binary())
    if kind == "int":
        return pa.array(
            draw(st.lists(st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)), min_size=n, max_size=n)), pa.int64()
        )
    if kind == "float":
        return pa.array(draw(st.lists(st.floats(), min_size=n, max_size=n)), pa.float64())
    if kind == "bool":
        return pa.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), pa.bool_())
    if kind == "list":
        return pa.array(
            [[s.encode("utf-8", "surrogatepass").decode("utf-8", "replace")] if s else None for s in strings],
            pa.list_(pa.string()),
        )
    if kind == "timestamp":  # some beyond what a Python datetime holds
        return pa.array(draw(st.lists(st.integers(-(2**62), 2**62), min_size=n, max_size=n)), pa.timestamp("ms"))
    if kind == "struct":
        return pa.array([{"k": i, "v": [i, i]} for i in range(n)])
    return pa.nulls(n)


@st.composite
def parquet_files(draw) -> tuple[str, bytes]:
    n = draw(st.integers(0, 6))
    kinds = ["string", "string", "binary", "int", "float", "bool", "list", "struct", "timestamp", "null"]
    columns = {}
    for name in ("id", "text", "tenant", "metadata"):
        if draw(st.integers(0, 5)):
            columns[name] = _column(draw(st.sampled_from(kinds)), n, draw)
    if draw(st.booleans()):
        columns["extra"] = _column("string", n, draw)
    buf = io.BytesIO()
    pq.write_table(pa.table(columns) if columns else pa.table({"x": pa.nulls(n)}), buf)
    data = buf.getvalue()
    if draw(st.integers(0, 3)) == 0:
        data = draw(mutated(data))
    return "f.parquet", data


random_files = st.tuples(
    st.sampled_from(["r.jsonl", "r.jsonl.gz", "r.parquet", "r.txt", "r.md"]),
    st.one_of(st.binary(max_size=600), st.sampled_from(SNIPPETS)),
)
text_files = st.tuples(
    st.sampled_from(["t.txt", "n.md"]),
    st.one_of(hostile_text.map(lambda s: s.encode("utf-8", "surrogatepass")), st.binary(max_size=64)),
)


# --- the oracle: an independent, simple parse of the record a valid row came from -----------------


def _decompressed(data: bytes) -> tuple[bytes, bool]:
    """(what the gzip module yields from `data` before any damage, whether it read to the end)."""
    out = bytearray()
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(data)) as f:
            while chunk := f.read(1 << 16):
                out += chunk
    except (EOFError, OSError, zlib.error):
        return bytes(out), False
    return bytes(out), True


def _record_lines(data: bytes) -> int:
    data = data.removeprefix(b"\xef\xbb\xbf")
    return sum(1 for line in data.split(b"\n") if line.removesuffix(b"\r").strip())


def _expected_rows(name: str, data: bytes) -> tuple[int, bool]:
    """(records an independent reading finds in the file (before any damage), whether it is damaged)."""
    if name.endswith((".txt", ".md")):
        return 1, False
    if name.endswith(".parquet"):
        try:
            parquet = pq.ParquetFile(pa.BufferReader(data))
            return parquet.read(columns=[c for c in FIELDS if c in parquet.schema_arrow.names]).num_rows, False
        except (pa.ArrowException, OSError, UnicodeDecodeError):  # a column named in bytes that are not UTF-8
            return 0, True
    if name.endswith(".gz"):
        text, whole = _decompressed(data)
        if not whole:
            return _record_lines(text[: text.rfind(b"\n") + 1]), True
        data = text
    return _record_lines(data), False


def _line_record(data: bytes, line: int, whole: bool):
    lines = data.split(b"\n")
    if line > len(lines) or (not whole and line == len(lines)):
        return None  # past what the oracle could decompress, or the partial line where the damage starts
    raw = lines[line - 1]
    if line == 1 and raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    return json.loads(raw.removesuffix(b"\r").decode("utf-8"))


def _expected(name: str, data: bytes, line: int | None) -> dict | None:
    """{"id", "text", "tenant"} of the record at `line` of file `name`, or None where the oracle cannot tell."""
    if name.endswith((".txt", ".md")):
        return {"id": name, "text": data.decode("utf-8"), "tenant": None}
    if name.endswith(".parquet"):
        parquet = pq.ParquetFile(pa.BufferReader(data))
        columns = [c for c in ("id", "text", "tenant") if c in parquet.schema_arrow.names]
        row = parquet.read(columns=columns).slice(line - 1, 1).to_pylist()[0]
    else:
        text, whole = _decompressed(data) if name.endswith(".gz") else (data, True)
        row = _line_record(text, line, whole)
        if row is None:
            return None
    tenant = row.get("tenant")
    return {"id": str(row.get("id")), "text": row.get("text"), "tenant": None if tenant in (None, "") else str(tenant)}


def check(files: list[tuple[str, bytes]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        inputs = {}
        for i, (name, data) in enumerate(files):
            name = f"{i}-{name}"
            Path(tmp, name).write_bytes(data)
            inputs[name] = data
        raw, notes = read_records(tmp, CONFIG)
        valid, quarantine = validate_records(raw, CONFIG, "fuzz")

    keys = list(zip(raw["file"].to_pylist(), raw["line"].to_pylist()))
    assert len(keys) == len(set(keys)), "two raw rows share a (file, line)"
    valid_keys = list(zip(valid["file"].to_pylist(), valid["line"].to_pylist()))
    quarantined = list(zip(quarantine["file"].to_pylist(), quarantine["line"].to_pylist()))
    assert not set(valid_keys) & set(quarantined), "a record is both valid and quarantined"
    assert sorted(valid_keys + quarantined, key=repr) == sorted(keys, key=repr), "a record went missing"
    assert set(quarantine["reason"].to_pylist()) <= set(REASONS)
    files = raw["file"].to_pylist()
    unreadable = {
        f for f, r in zip(quarantine["file"].to_pylist(), quarantine["reason"].to_pylist()) if r == "unreadable_file"
    }
    for name, data in inputs.items():
        expected, damaged = _expected_rows(name, data)
        got = files.count(name)
        if damaged:  # the records before the damage (and the damage itself) are accounted for
            assert name in unreadable and got >= expected + 1, (name, got, expected)
        else:
            assert got == expected, f"{name}: {got} rows read, {expected} records in the file"
        if not got:
            assert any(note.startswith(f"{name}: ") for note in notes), f"{name} gave no row and no note"

    ids = valid["id"].to_pylist()
    assert len(ids) == len(set(ids)) and None not in ids
    for row in valid.to_pylist():
        assert "\x00" not in row["id"] and "\x00" not in row["tenant"]
        assert len(row["tenant"]) <= TENANT_MAX_CHARS and isinstance(row["text"], str) and row["text"].strip()
        want = _expected(row["file"], inputs[row["file"]], row["line"])
        if want is not None:
            assert row["id"].encode() == want["id"].encode(), (row, want)
            assert row["text"].encode() == want["text"].encode()
            assert row["tenant"] == (want["tenant"] or CONFIG.default_tenant)
    for table in (valid, quarantine):  # what the later stages write must be writable
        pq.write_table(table, io.BytesIO())


def fuzz_settings(share: int = 1):
    """The selected profile; `share`: this test's weight in the suite's bounded run."""
    return settings(PROFILE, max_examples=FUZZ_EXAMPLES or 60 * share)


# Known reproducers, run in every profile before the generated examples.
_GOOD = b'{"id": "ok", "text": "fine"}\n'
_TRUNCATED = gzip.compress(b"".join(b'{"id": "%d", "text": "t"}\n' % i for i in range(50)))
REPRODUCERS = [
    [("f.jsonl", _GOOD + rb'{"id": "a", "text": "x \ud800"}' + b"\n")],
    [("f.jsonl", _GOOD + rb'{"id": "a\udfff", "text": "x", "tenant": "\ud800", "metadata": {"\udc00": 1}}')],
    [("f.jsonl", _GOOD + b'{"id": "a", "text": "x", "n": ' + b"1" * 5000 + b"}\n")],
    [("f.jsonl", _GOOD + b"[" * 100_000 + b"\n")],
    [("f.jsonl", _GOOD + json.dumps({"id": "a", "text": "x", "tenant": "t" * 201}).encode())],
    [
        (
            "f.jsonl",
            _GOOD
            + json.dumps({"id": "a\x00", "text": "x"}).encode()
            + b"\n"
            + json.dumps({"id": "b", "text": "x", "tenant": "a\x00b"}).encode(),
        )
    ],
    [("f.jsonl", _GOOD + b'{"id": "a", "text": "x", "tenant": {"a": 1}}\n{"id": "b", "text": "x", "tenant": false}')],
    [("f.jsonl", b"\xef\xbb\xbf" + _GOOD), ("g.jsonl", b'{"id": "a",\r"text": "x"}\r\n')],
    [("f.jsonl.gz", _TRUNCATED[: len(_TRUNCATED) // 2]), ("e.jsonl.gz", b"")],
]


@fuzz_settings(share=2)
@given(st.lists(jsonl_files(), min_size=1, max_size=2))
def test_fuzz_mutated_jsonl(files):
    check(files)


for files in REPRODUCERS:
    test_fuzz_mutated_jsonl = example(files)(test_fuzz_mutated_jsonl)


@fuzz_settings()
@given(st.lists(parquet_files(), min_size=1, max_size=2))
def test_fuzz_parquet_with_wrong_types(files):
    check(files)


@fuzz_settings()
@given(st.lists(random_files, min_size=1, max_size=3))
def test_fuzz_random_bytes(files):
    check(files)


@fuzz_settings()
@given(st.lists(st.one_of(jsonl_files(), parquet_files(), random_files, text_files), min_size=1, max_size=4))
def test_fuzz_mixed_folder(files):
    check(files)
