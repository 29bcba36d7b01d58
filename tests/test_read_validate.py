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
    assert reasons(quarantine) == sorted([
        "malformed_json", "missing_text", "empty_text", "non_string_text", "missing_id", "duplicate_id",
        "invalid_utf8", "too_large", "not_an_object", "unreadable_file"])
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
    assert skipped == ["ignored.csv"]


def test_truncated_gzip_keeps_what_was_read_and_quarantines_the_rest(tmp_path):
    data = gzip.compress(b"".join(json.dumps({"id": str(i), "text": "t " * 50}).encode() + b"\n" for i in range(200)))
    (tmp_path / "t.jsonl.gz").write_bytes(data[: len(data) // 2])
    raw, valid, quarantine, _ = run(tmp_path)
    assert reasons(quarantine) == ["unreadable_file"]
    assert valid.num_rows + quarantine.num_rows == raw.num_rows


def test_invalid_utf8_text_file(tmp_path):
    (tmp_path / "x.txt").write_bytes(b"caf\xe9")
    _, valid, quarantine, _ = run(tmp_path)
    assert valid.num_rows == 0 and reasons(quarantine) == ["invalid_utf8"]
    assert quarantine["id"].to_pylist() == ["x.txt"]


def test_size_limit_counts_utf8_bytes(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"id": "e", "text": "é" * 60}) + "\n"
                                      + json.dumps({"id": "a", "text": "a" * 100}) + "\n")
    _, valid, quarantine, _ = run(tmp_path, max_document_bytes=100)
    assert valid["id"].to_pylist() == ["a"] and quarantine["id"].to_pylist() == ["e"]


def test_partitions_are_stable_and_chunked(tmp_path):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"id": str(i), "text": "x"}) + "\n" for i in range(25)))
    raw, *_ = run(tmp_path, records_per_partition=10)
    parts = raw["partition"].to_pylist()
    assert parts[:10] == [partition_id("a.jsonl", 0)] * 10
    assert sorted(set(parts)) == sorted(partition_id("a.jsonl", c) for c in range(3))


def test_missing_input_folder_is_a_clear_error(tmp_path):
    from pipeline.stores.storage import StorageError

    with pytest.raises(StorageError, match="input not found"):
        read_records(str(tmp_path / "nope"), InputConfig())


def test_unsupported_scheme_is_a_clear_error():
    from pipeline.stores.storage import StorageError, resolve

    with pytest.raises(StorageError, match="gs:// scheme is not supported"):
        resolve("gs://bucket/x")
