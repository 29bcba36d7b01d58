"""The partition commit protocol (pipeline/output/commit.py) and atomic writes (stores/storage.py).

Readers see a partition whole or not at all, whatever point a writer died at; a failed S3 write
never publishes a partial object under its final name and leaves no upload behind; the input
listing never follows a link out of the input folder.
"""

import logging
import os
import uuid

import pyarrow as pa
import pytest

from pipeline.config import StorageConfig
from pipeline.output.commit import SCHEMAS, new_commit_id, part_path, publish, write_files
from pipeline.output.ledger import connect
from pipeline.stores import storage


def partition_tables(partition: str, ids: list[str]) -> dict[str, pa.Table]:
    """One partition's three tables, one row per id in outputs and ledger, none in quarantine."""
    rows = [
        {
            "partition": partition,
            "id": i,
            "job_id": "j",
            "tenant": "t",
            "summary": f"summary of {i}",
            "cost_usd": 1.0,
            "gpu_seconds": 1.0,
        }
        for i in ids
    ]
    with_partition = {
        k: pa.schema([("partition", pa.string()), *s]) if "partition" not in s.names else s for k, s in SCHEMAS.items()
    }
    return {
        "outputs": pa.Table.from_pylist(rows, schema=with_partition["outputs"]),
        "ledger": pa.Table.from_pylist(rows, schema=with_partition["ledger"]),
        "quarantine": with_partition["quarantine"].empty_table(),
    }


def seen(output: str) -> dict[str, list[str]]:
    con = connect(output)
    return {
        kind: sorted(r[0] for r in con.execute(f"SELECT id FROM {kind}").fetchall()) for kind in ("outputs", "ledger")
    }


def test_readers_see_a_partition_whole_or_not_at_all(tmp_path):
    out = str(tmp_path / "out")
    root = storage.resolve(out)
    first = new_commit_id(1)
    publish(root, "j", "p", first, write_files(root, "j", "p", partition_tables("p", ["a", "b"]), "zstd", first))
    assert seen(out) == {"outputs": ["a", "b"], "ledger": ["a", "b"]}

    # A second attempt dies between its writes: its outputs file exists, its ledger does not.
    second = new_commit_id(2)
    tables = partition_tables("p", ["a", "b", "c"])
    storage.write_parquet_atomic(
        root, part_path(root, "outputs", "j", "p", second), tables["outputs"].select(SCHEMAS["outputs"].names), "zstd"
    )
    assert seen(out) == {"outputs": ["a", "b"], "ledger": ["a", "b"]}  # still the first commit, whole

    # A partition whose only attempt died before its commit is not there at all.
    lone = new_commit_id(1)
    write_files(root, "j", "q", partition_tables("q", ["z"]), "zstd", lone)
    assert "z" not in seen(out)["outputs"] and "z" not in seen(out)["ledger"]

    # The rerun commits: readers switch to it at once, and the older files are gone from the folder.
    files = write_files(root, "j", "p", tables, "zstd", second)
    publish(root, "j", "p", second, files)
    assert seen(out) == {"outputs": ["a", "b", "c"], "ledger": ["a", "b", "c"]}
    for kind in ("outputs", "ledger", "quarantine"):
        left = sorted(os.listdir(tmp_path / "out" / kind / "job=j" / "partition=p"))
        assert left == [files[kind].rsplit("/", 1)[1]]


def test_partitions_written_before_commit_records_are_still_read(tmp_path):
    out = str(tmp_path / "out")
    root = storage.resolve(out)
    tables = partition_tables("old", ["x"])
    for kind in ("outputs", "ledger", "quarantine"):
        storage.write_parquet_atomic(
            root,
            root.join(kind, "job=j", "partition=old", "part-0.parquet"),
            tables[kind].select(SCHEMAS[kind].names),
            "zstd",
        )
    assert seen(out) == {"outputs": ["x"], "ledger": ["x"]}


def test_local_writes_leave_no_temporary_file_on_failure(tmp_path):
    root = storage.resolve(str(tmp_path))
    storage.write_bytes_atomic(root, root.join("d", "f.json"), b"old")
    with pytest.raises(storage.StorageError, match="disk full"):
        storage.write_bytes_atomic(storage.Location(_FailingMove(root.fs), root.path), root.join("d", "f.json"), b"new")
    assert (tmp_path / "d" / "f.json").read_bytes() == b"old"
    assert os.listdir(tmp_path / "d") == ["f.json"]


class _FailingMove:
    """A local filesystem whose rename fails, as a full disk or a lost mount would make it."""

    def __init__(self, fs):
        self.fs = fs

    def __getattr__(self, name):
        return getattr(self.fs, name)

    def move(self, src, dst):
        raise OSError("disk full")


def test_a_failed_s3_write_publishes_nothing_and_leaves_no_upload(s3_proxy, s3_client):
    bucket = f"tm-{uuid.uuid4().hex[:8]}"
    s3_client.create_bucket(Bucket=bucket)
    root = storage.resolve(f"s3://{bucket}/out", StorageConfig(s3_endpoint_url=s3_proxy.url, s3_max_attempts=1))
    path = root.join("ledger", "part-x.parquet")
    storage.write_bytes_atomic(root, path, b"old contents")

    # The store refuses every request for the object: the write fails, the old object stands.
    s3_proxy.fail(f"/{bucket}/out/ledger/part-x.parquet")
    with pytest.raises(storage.StorageError, match="part-x.parquet"):
        storage.write_bytes_atomic(root, path, b"new contents")
    # A multipart upload breaking half-way (its second part refused): pyarrow's output stream would
    # complete it on close with the first part only (apache/arrow#40502), or leave it incomplete.
    s3_proxy.fail("partNumber=2")
    big = os.urandom(25 * 1024 * 1024)
    with pytest.raises(storage.StorageError):
        storage.write_bytes_atomic(root, path, big)
    s3_proxy.fail(None)
    keys = [
        o["Key"] for o in s3_client.list_objects_v2(Bucket=bucket).get("Contents", []) if not o["Key"].endswith("/")
    ]  # pyarrow's folder markers
    assert keys == ["out/ledger/part-x.parquet"]  # no temporary object left
    assert s3_client.get_object(Bucket=bucket, Key=keys[0])["Body"].read() in (b"old contents", big)
    assert not s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads")


def test_links_out_of_the_input_folder_are_skipped_with_a_warning(tmp_path, caplog):
    top = tmp_path / "in"
    (top / "sub").mkdir(parents=True)
    (top / "a.jsonl").write_text('{"id": "a", "text": "x"}\n')
    outside = tmp_path / "secret.txt"
    outside.write_text("not for reading")
    os.symlink(outside, top / "escape.txt")
    os.symlink(tmp_path / "missing.txt", top / "dangling.txt")
    os.symlink(top / "a.jsonl", top / "sub" / "again.jsonl")  # inside the folder: read
    os.symlink(tmp_path, top / "loop")  # a linked folder: not followed
    with caplog.at_level(logging.WARNING, logger="pipeline.stores.storage"):
        listed = [rel for rel, _, _ in storage.list_files(storage.resolve(str(top)))]
    assert listed == ["a.jsonl", "sub/again.jsonl"]
    for name in ("escape.txt", "dangling.txt", "loop"):
        assert name in caplog.text


def test_a_file_whose_name_is_not_utf8_is_skipped_with_a_warning(tmp_path, caplog):
    top = tmp_path / "in"
    top.mkdir()
    (top / "good.jsonl").write_text('{"id": "a", "text": "x"}\n')
    with open(os.path.join(os.fsencode(top), b"bad-\xff.jsonl"), "wb") as f:
        f.write(b'{"id": "b", "text": "y"}\n')
    with caplog.at_level(logging.WARNING, logger="pipeline.stores.storage"):
        listed = [rel for rel, _, _ in storage.list_files(storage.resolve(str(top)))]
    assert listed == ["good.jsonl"] and "not valid UTF-8" in caplog.text


def test_only_regular_files_are_inputs_and_an_unlistable_folder_is_named(tmp_path, monkeypatch, caplog):
    """Reproducers (red team): a FIFO named like an input file (`b.jsonl`) made `estimate` and `run` block
    forever; a folder that could not be listed was dropped without a word (os.walk without onerror)."""
    top = tmp_path / "in"
    (top / "locked").mkdir(parents=True)
    (top / "a.jsonl").write_text('{"id": "a", "text": "x"}\n')
    (top / "locked" / "c.jsonl").write_text('{"id": "c", "text": "z"}\n')
    os.mkfifo(top / "b.jsonl")
    real_scandir = os.scandir

    def scandir(path="."):  # as a folder without read permission does for a user other than root
        if os.fspath(path).endswith("locked"):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_scandir(path)

    skipped: list[str] = []
    # Undone before tmp_path's removal, which scans folders by descriptor.
    with monkeypatch.context() as m, caplog.at_level(logging.WARNING, logger="pipeline.stores.storage"):
        m.setattr(os, "scandir", scandir)
        listed = [rel for rel, _, _ in storage.list_files(storage.resolve(str(top)), skipped)]
    assert listed == ["a.jsonl"]
    assert [n.split(":")[0] for n in skipped] == ["b.jsonl", "locked"]
    assert "not a regular file" in skipped[0] and "cannot be listed" in skipped[1] and "Permission denied" in skipped[1]
    assert "b.jsonl" in caplog.text and "locked" in caplog.text


def test_a_late_publish_of_an_older_commit_keeps_the_newer_one(tmp_path):
    """Worker A committed (epoch 1) and stalled before its record; a forced rerun committed epoch 2
    and published; A's record then arrives late. It must neither replace nor delete epoch 2."""
    out = str(tmp_path / "out")
    root = storage.resolve(out)
    old, new = new_commit_id(1), new_commit_id(2)
    old_files = write_files(root, "j", "p", partition_tables("p", ["a"]), "zstd", old)
    new_files = write_files(root, "j", "p", partition_tables("p", ["a", "b"]), "zstd", new)
    assert publish(root, "j", "p", new, new_files)
    assert not publish(root, "j", "p", old, old_files)
    assert seen(out) == {"outputs": ["a", "b"], "ledger": ["a", "b"]}
    assert all((tmp_path / "out" / name).exists() for name in new_files.values())


def test_local_writes_are_fsynced_file_then_folder(tmp_path, monkeypatch):
    synced = []
    real = os.fsync

    def spy(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    root = storage.resolve(str(tmp_path))
    storage.write_bytes_atomic(root, root.join("d", "f.json"), b"x")
    # The data, before its rename, under a name no glob of `*.json` reads: (the name it becomes).tmp-(uuid)
    assert len(synced) == 2 and storage.temporary_target(synced[0].rsplit("/", 1)[1]) == "f.json"
    assert synced[1] == str(tmp_path / "d")  # then the folder, so the rename itself survives a power cut
