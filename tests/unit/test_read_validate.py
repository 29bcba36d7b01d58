import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import InputConfig
from pipeline.dev.samples import write_sample_corpus
from pipeline.ingest.read import partition_id, read_records
from pipeline.ingest.validate import validate_records


def run(tmp_path, **cfg):
    config = InputConfig(**cfg)
    raw, skipped = read_records(str(tmp_path), config)
    valid, quarantine = validate_records(raw, config, "job-1")
    return raw, valid, quarantine, skipped


def reasons(quarantine) -> list[str]:
    return sorted(quarantine["reason"].to_pylist())


def test_every_kind_of_bad_input_is_one_quarantine_row(tmp_path):
    counts = write_sample_corpus(tmp_path, documents=30)
    raw, valid, quarantine, _ = run(tmp_path)
    assert raw.num_rows == counts["documents"] + counts["bad_records"]
    assert valid.num_rows + quarantine.num_rows == raw.num_rows
    assert reasons(quarantine) == sorted(
        [
            "malformed_json",
            "missing_text",
            "empty_text",
            "non_string_text",
            "missing_id",
            "duplicate_id",
            "invalid_utf8",
            "too_large",
            "not_an_object",
            "unreadable_file",
        ]
    )
    row = quarantine.filter(pa.compute.equal(quarantine["reason"], "malformed_json")).to_pylist()[0]
    assert row["file"] == "bad.jsonl" and row["line"] == 1 and row["excerpt"].startswith('{"id": "bad-json"')
    assert row["job_id"] == "job-1"
    huge = quarantine.filter(pa.compute.equal(quarantine["reason"], "too_large")).to_pylist()[0]
    assert huge["id"] == "huge" and len(huge["excerpt"]) <= 200


def test_duplicate_id_first_occurrence_wins(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"id": "x", "text": "first"}\n{"id": "x", "text": "second"}\n')
    _, valid, quarantine, _ = run(tmp_path)
    assert valid["text"].to_pylist() == ["first"]
    assert reasons(quarantine) == ["duplicate_id"]


def test_invalid_first_occurrence_does_not_shadow_a_valid_one(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"id": "x", "text": "  "}\n{"id": "x", "text": "valid"}\n')
    _, valid, quarantine, _ = run(tmp_path)
    assert valid["text"].to_pylist() == ["valid"] and reasons(quarantine) == ["empty_text"]


def test_formats_ids_tenants_and_metadata(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "n.md").write_text("# Title\nbody")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write(json.dumps({"id": 7, "text": "seven", "tenant": "t1", "metadata": {"k": [1, 2]}}) + "\n")
    pq.write_table(pa.table({"id": ["p1"], "text": ["from parquet"]}), tmp_path / "c.parquet")
    (tmp_path / "ignored.csv").write_text("a,b\n")
    _, valid, quarantine, skipped = run(tmp_path, default_tenant="house")
    rows = {r["id"]: r for r in valid.to_pylist()}
    assert set(rows) == {"sub/n.md", "7", "p1"} and quarantine.num_rows == 0
    assert rows["7"]["tenant"] == "t1" and json.loads(rows["7"]["metadata"]) == {"k": [1, 2]}
    assert rows["sub/n.md"]["tenant"] == "house" and rows["sub/n.md"]["line"] is None
    assert rows["p1"]["line"] == 1
    assert skipped == ["ignored.csv: skipped, not .jsonl, .jsonl.gz, .parquet, .txt or .md"]


def test_truncated_gzip_keeps_what_was_read_and_quarantines_the_rest(tmp_path):
    plain = b"".join(json.dumps({"id": str(i), "text": f"t{i} " * 50}).encode() + b"\n" for i in range(200))
    data = gzip.compress(plain)
    (tmp_path / "t.jsonl.gz").write_bytes(data[: len(data) // 2])
    raw, valid, quarantine, _ = run(tmp_path)
    kept = valid["id"].to_pylist()
    # The records before the damage, in order, and none after it.
    assert 0 < len(kept) < 200 and kept == [str(i) for i in range(len(kept))]
    assert reasons(quarantine) == ["unreadable_file"]
    row = quarantine.to_pylist()[0]
    lost_at = sum(len(line) + 1 for line in plain.split(b"\n")[: len(kept)])  # first byte of the lost record
    assert f"byte {lost_at}" in row["detail"] and row["line"] == len(kept) + 1
    assert valid.num_rows + quarantine.num_rows == raw.num_rows


def test_corrupt_gzip_member_keeps_the_members_before_it(tmp_path):
    good = gzip.compress(b'{"id": "a", "text": "x"}\n')
    (tmp_path / "c.jsonl.gz").write_bytes(good + b"\x1f\x8b garbage that is not deflate")
    _, valid, quarantine, _ = run(tmp_path)
    assert valid["id"].to_pylist() == ["a"] and reasons(quarantine) == ["unreadable_file"]
    assert "byte" in quarantine["detail"][0].as_py()


def test_empty_gzip_file_is_reported_not_silent(tmp_path):
    (tmp_path / "e.jsonl.gz").write_bytes(b"")
    (tmp_path / "ok.jsonl").write_text('{"id": "a", "text": "x"}\n')
    _, valid, quarantine, skipped = run(tmp_path)
    assert valid.num_rows == 1 and quarantine.num_rows == 0
    assert [s for s in skipped if s.startswith("e.jsonl.gz")] == ["e.jsonl.gz: empty file (0 bytes), no records"]


@pytest.mark.parametrize(
    "line",
    [
        r'{"id": "s", "text": "x \ud800"}',
        r'{"id": "s\udfff", "text": "x"}',
        r'{"id": "s", "text": "x", "tenant": "t\ud800"}',
        r'{"id": "s", "text": "x", "metadata": {"k": "\udc00"}}',
        r'{"id": "s", "text": "x", "metadata": {"\ud800": 1}}',
    ],
)
def test_lone_surrogate_is_one_invalid_unicode_row(tmp_path, line):
    (tmp_path / "a.jsonl").write_text('{"id": "ok", "text": "fine \\ud83d\\ude00"}\n' + line + "\n")
    _, valid, quarantine, _ = run(tmp_path)
    assert valid["id"].to_pylist() == ["ok"] and valid["text"].to_pylist() == ["fine \U0001f600"]
    assert reasons(quarantine) == ["invalid_unicode"] and quarantine["line"].to_pylist() == [2]
    assert "surrogate" in quarantine["detail"][0].as_py()


def test_surrogate_escape_in_an_unused_field_is_harmless(tmp_path):
    (tmp_path / "a.jsonl").write_text(r'{"id": "a", "text": "x", "other": "\ud800"}' + "\n")
    _, valid, quarantine, _ = run(tmp_path)
    assert valid["id"].to_pylist() == ["a"] and quarantine.num_rows == 0


def test_number_too_long_is_one_row(tmp_path):
    digits = "1" * 5000
    (tmp_path / "a.jsonl").write_text(
        f'{{"id": "a", "text": "x", "metadata": {{"n": {digits}}}}}\n'
        f'{{"id": {digits}, "text": "x"}}\n{{"id": "b", "text": "y"}}\n'
    )
    _, valid, quarantine, _ = run(tmp_path)
    assert valid["id"].to_pylist() == ["b"] and reasons(quarantine) == ["number_too_long"] * 2


@pytest.mark.parametrize(
    "line",
    [
        "[" * 100_000,
        '{"id": "a", "text": "x", "metadata": ' + "[" * 100_000,
        '{"id": "a", "text": "x", "metadata": ' + "[" * 500 + "]" * 500 + "}",
    ],
)
def test_deep_nesting_is_one_row(tmp_path, line):
    (tmp_path / "a.jsonl").write_text(line + '\n{"id": "b", "text": "y"}\n')
    _, valid, quarantine, _ = run(tmp_path)
    assert valid["id"].to_pylist() == ["b"] and reasons(quarantine) == ["too_deeply_nested"]


def test_moderate_nesting_is_accepted(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"id": "a", "text": "[[[[", "metadata": ' + "[" * 50 + "]" * 50 + "}\n")
    _, valid, quarantine, _ = run(tmp_path)
    assert valid["id"].to_pylist() == ["a"] and quarantine.num_rows == 0


def test_what_the_catalog_cannot_store_is_quarantined(tmp_path):
    lines = [
        {"id": "long-tenant", "text": "x", "tenant": "t" * 201},
        {"id": "max-tenant", "text": "x", "tenant": "é" * 200},  # 200 characters: fits String(200)
        {"id": "nul-tenant", "text": "x", "tenant": "a\x00b"},
        {"id": "nul\x00id", "text": "x"},
        {"id": "nul-text", "text": "a\x00b"},
    ]  # text never reaches the catalog: accepted
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    _, valid, quarantine, _ = run(tmp_path)
    assert valid["id"].to_pylist() == ["max-tenant", "nul-text"]
    got = dict(zip(quarantine["line"].to_pylist(), quarantine["reason"].to_pylist()))
    assert got == {1: "invalid_tenant", 3: "invalid_tenant", 4: "invalid_id"}
    assert all(quarantine["detail"].to_pylist())


@pytest.mark.parametrize("tenant", [{"a": 1}, False, True, 1.5, ["t"]])
def test_non_string_tenant_is_quarantined_not_stringified(tmp_path, tenant):
    (tmp_path / "a.jsonl").write_text(json.dumps({"id": "a", "text": "x", "tenant": tenant}) + "\n")
    _, valid, quarantine, _ = run(tmp_path)
    assert valid.num_rows == 0 and reasons(quarantine) == ["invalid_tenant"]


def test_integer_tenant_is_its_decimal_string_like_an_id(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"id": "a", "text": "x", "tenant": 42}) + "\n")
    _, valid, _, _ = run(tmp_path)
    assert valid["tenant"].to_pylist() == ["42"]


def test_parquet_with_wrong_types_and_bad_utf8_quarantines_row_by_row(tmp_path):
    bad_utf8 = pa.array([b"ok", b"\xff\xfe", b"ok3"]).view(pa.string())
    pq.write_table(
        pa.table({"id": ["p1", "p2", "p3"], "text": bad_utf8, "tenant": pa.array([b"t", b"t", b"t"])}),
        tmp_path / "a.parquet",
    )
    pq.write_table(pa.table({"id": pa.array([["x"], ["y"]]), "text": ["a", "b"]}), tmp_path / "b.parquet")
    _, valid, quarantine, _ = run(tmp_path)
    assert valid.num_rows == 0
    got = sorted(zip(quarantine["file"].to_pylist(), quarantine["line"].to_pylist(), quarantine["reason"].to_pylist()))
    assert got == [
        ("a.parquet", 1, "invalid_tenant"),
        ("a.parquet", 2, "invalid_utf8"),
        ("a.parquet", 3, "invalid_tenant"),
        ("b.parquet", 1, "invalid_id"),
        ("b.parquet", 2, "invalid_id"),
    ]


def test_parquet_value_python_cannot_hold_is_one_row(tmp_path):
    when = pa.array([0, 2**62], pa.timestamp("ms"))  # year 146 million: no datetime holds it
    pq.write_table(
        pa.table({"id": ["a", "b"], "text": ["x", "y"], "metadata": pa.StructArray.from_arrays([when], ["when"])}),
        tmp_path / "a.parquet",
    )
    _, valid, quarantine, _ = run(tmp_path)
    assert valid["id"].to_pylist() == ["a"] and reasons(quarantine) == ["unreadable_value"]
    assert quarantine["line"].to_pylist() == [2] and "OverflowError" in quarantine["detail"][0].as_py()


def test_tenant_limit_is_the_catalogs():
    from pipeline.ingest.validate import TENANT_MAX_CHARS
    from pipeline.stores.catalog import Item

    assert Item.__table__.c.tenant.type.length == TENANT_MAX_CHARS


def test_utf8_bom_is_accepted(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(b'\xef\xbb\xbf{"id": "a", "text": "x"}\n{"id": "b", "text": "y"}\n')
    with gzip.open(tmp_path / "b.jsonl.gz", "wb") as f:
        f.write(b'\xef\xbb\xbf{"id": "c", "text": "z"}\n')
    _, valid, quarantine, _ = run(tmp_path)
    assert valid["id"].to_pylist() == ["a", "b", "c"] and quarantine.num_rows == 0


def test_lines_split_only_on_newlines(tmp_path):
    # A bare CR inside an object is JSON whitespace, not a line end; CRLF line ends still work.
    (tmp_path / "a.jsonl").write_bytes(
        b'{"id": "a",\r"text": "x"}\r\n{"id":\r\r"b", "text": "y"}\r\n{"id": "c", "text": "z"}'
    )
    _, valid, quarantine, _ = run(tmp_path)
    assert valid["id"].to_pylist() == ["a", "b", "c"] and valid["line"].to_pylist() == [1, 2, 3]
    assert quarantine.num_rows == 0


def test_invalid_utf8_text_file(tmp_path):
    (tmp_path / "x.txt").write_bytes(b"caf\xe9")
    _, valid, quarantine, _ = run(tmp_path)
    assert valid.num_rows == 0 and reasons(quarantine) == ["invalid_utf8"]
    assert quarantine["id"].to_pylist() == ["x.txt"]


def test_size_limit_counts_utf8_bytes(tmp_path):
    (tmp_path / "a.jsonl").write_text(
        json.dumps({"id": "e", "text": "é" * 60}) + "\n" + json.dumps({"id": "a", "text": "a" * 100}) + "\n"
    )
    _, valid, quarantine, _ = run(tmp_path, max_document_bytes=100)
    assert valid["id"].to_pylist() == ["a"] and quarantine["id"].to_pylist() == ["e"]


def test_partitions_are_stable_and_chunked(tmp_path):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"id": str(i), "text": "x"}) + "\n" for i in range(25)))
    raw, *_ = run(tmp_path, records_per_partition=10)
    parts = raw["partition"].to_pylist()
    assert parts[:10] == [partition_id("a.jsonl", 0)] * 10
    assert sorted(set(parts)) == sorted(partition_id("a.jsonl", c) for c in range(3))


def read_in_batches(tmp_path, name: str, **cfg) -> tuple[pa.Table, list[pa.Table], str | None]:
    """One file read whole, and read a partition at a time (as planning reads it)."""
    from pipeline.ingest.read import FileReader
    from pipeline.stores import storage

    config, root = InputConfig(**cfg), storage.resolve(str(tmp_path))
    whole = FileReader(root, name, str(tmp_path / name), config).table()
    reader = FileReader(root, name, str(tmp_path / name), config)
    batches = list(reader.partitions())
    return whole, batches, reader.note


def test_a_file_read_a_partition_at_a_time_gives_what_reading_it_whole_gives(tmp_path):
    """Planning keys a large file partition by partition (the file's records never held at once): each batch is
    one whole partition, in order, and together they are the file's records, bad ones and a damaged tail included."""
    lines = [json.dumps({"id": str(i), "text": f"t{i} " * 50}).encode() for i in range(95)]
    lines[12], lines[40] = b"{not json", b"[1, 2]"
    data = gzip.compress(b"\n".join(lines) + b"\n")
    (tmp_path / "t.jsonl.gz").write_bytes(data[: len(data) * 3 // 4])  # truncated: its tail is one row
    whole, batches, note = read_in_batches(tmp_path, "t.jsonl.gz", records_per_partition=10)
    assert note is None and len(batches) > 3
    assert all(len(set(b["partition"].to_pylist())) == 1 for b in batches)
    assert [b["partition"][0].as_py() for b in batches] == list(dict.fromkeys(whole["partition"].to_pylist()))
    assert pa.concat_tables(batches).equals(whole)
    assert whole["read_error"].to_pylist().count("unreadable_file") == 1


def test_a_failure_downstream_of_the_reader_is_not_blamed_on_the_file(tmp_path):
    """An error of the batch consumer (a full disk while staging) stops the read as itself: it never becomes
    an `unreadable_file` row that would quarantine the rest of a good file."""
    from pipeline.ingest.read import FileReader
    from pipeline.stores import storage

    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"id": str(i), "text": "x"}) + "\n" for i in range(25)))
    reader = FileReader(
        storage.resolve(str(tmp_path)), "a.jsonl", str(tmp_path / "a.jsonl"), InputConfig(records_per_partition=10)
    )
    with pytest.raises(OSError, match="No space left"):
        for _ in reader.partitions():
            raise OSError(28, "No space left on device")  # staging the first partition fails
    whole, batches, note = read_in_batches(tmp_path, "a.jsonl", records_per_partition=10)
    assert [b.num_rows for b in batches] == [10, 10, 5] and whole.num_rows == 25


def test_missing_input_folder_is_a_clear_error(tmp_path):
    from pipeline.stores.storage import StorageError

    with pytest.raises(StorageError, match="input not found"):
        read_records(str(tmp_path / "nope"), InputConfig())


def test_unsupported_scheme_is_a_clear_error():
    from pipeline.stores.storage import StorageError, resolve

    with pytest.raises(StorageError, match="gs:// scheme is not supported"):
        resolve("gs://bucket/x")


def test_a_parquet_column_name_that_is_not_utf8_is_one_unreadable_file_row(tmp_path):
    """Reproducer (the reader's fuzz test, seen once when it ran after the report tests): a Parquet file whose
    footer names a column in bytes that are not UTF-8 raised UnicodeDecodeError out of the reader."""
    import io

    buf = io.BytesIO()
    pq.write_table(pa.table({"id": ["a"], "text": ["hello"], "tenant": ["t"]}), buf)
    (tmp_path / "f.parquet").write_bytes(buf.getvalue().replace(b"\x06tenant", b"\x06\xf4enant", 1))
    _, valid, quarantine, _ = run(tmp_path)
    assert valid.num_rows == 0 and reasons(quarantine) == ["unreadable_file"]
    assert "UnicodeDecodeError" in quarantine["detail"][0].as_py()


def test_one_document_files_are_packed_into_partitions_by_count_and_bytes():
    from pipeline.ingest.read import pack_partition, packs

    files = [(f"notes/{i:03d}.txt", f"/in/notes/{i:03d}.txt", 100) for i in range(5)]
    files += [("z.jsonl", "/in/z.jsonl", 10), ("zz/a.md", "/in/zz/a.md", 100), ("zz/b.md", "/in/zz/b.md", 100)]
    groups = [[f[0] for f in g] for g in packs(files, records_per_partition=2)]
    # Runs of one-document files, cut at records_per_partition; any other file alone, and it ends a run.
    assert groups == [
        ["notes/000.txt", "notes/001.txt"],
        ["notes/002.txt", "notes/003.txt"],
        ["notes/004.txt"],
        ["z.jsonl"],
        ["zz/a.md", "zz/b.md"],
    ]
    assert [len(g) for g in packs(files[:5], records_per_partition=10, max_bytes=250)] == [2, 2, 1]  # bytes cap
    assert [len(g) for g in packs(files[:5], records_per_partition=10_000)] == [5]
    # A pack's id is its listing's: the same files give the same id, another run of files another.
    assert pack_partition(groups[0]) == pack_partition(list(groups[0])) != pack_partition(groups[1])
    assert pack_partition(["z.jsonl"]) == partition_id("z.jsonl", 0)  # alone: the file's own
