"""The partition commit protocol (pipeline/output/tables.py) and atomic writes (stores/storage.py).

Readers see a partition whole or not at all, whatever point a writer died at, and each partition once,
whichever committers race (local folder and S3); a failed S3 write never publishes a partial object under its
final name and leaves no upload behind; the input listing never follows a link out of the input folder.
"""

import logging
import multiprocessing
import os
import shutil
import uuid

import pyarrow as pa
import pyarrow.fs as pafs
import pytest
from deltalake import DeltaTable, write_deltalake

from pipeline.config import StorageConfig
from pipeline.output.ledger import connect
from pipeline.output.tables import KINDS, SCHEMAS, new_commit_id, open_table, publish, stage
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
    return {
        "outputs": pa.Table.from_pylist(rows, schema=SCHEMAS["outputs"]),
        "ledger": pa.Table.from_pylist(rows, schema=SCHEMAS["ledger"]),
        "quarantine": SCHEMAS["quarantine"].empty_table(),
    }


def seen(output: str, storage_config: StorageConfig | None = None) -> dict[str, list[str]]:
    con = connect(output, storage_config)
    return {
        kind: sorted(r[0] for r in con.execute(f"SELECT id FROM {kind}").fetchall()) for kind in ("outputs", "ledger")
    }


def staged(root, partition: str, ids: list[str], epoch: int) -> dict:
    return stage(root, "j", partition, partition_tables(partition, ids), "zstd", new_commit_id(epoch))


def test_readers_see_a_partition_whole_or_not_at_all(tmp_path):
    out = str(tmp_path / "out")
    root = storage.resolve(out)
    assert publish(root, "j", "p", 1, staged(root, "p", ["a", "b"], 1))
    assert seen(out) == {"outputs": ["a", "b"], "ledger": ["a", "b"]}
    versions = {kind: open_table(root, kind).version() for kind in KINDS}

    # A second attempt staged its files and died before the catalog's commit: no table names them.
    second = staged(root, "p", ["a", "b", "c"], 2)
    assert seen(out) == {"outputs": ["a", "b"], "ledger": ["a", "b"]}  # still the first commit, whole

    # A partition whose only attempt died before its commit is not there at all.
    staged(root, "q", ["z"], 1)
    assert "z" not in seen(out)["outputs"] and "z" not in seen(out)["ledger"]

    # The rerun commits: readers switch to it at once, in one new version of each table naming its files only.
    assert publish(root, "j", "p", 2, second)
    assert seen(out) == {"outputs": ["a", "b", "c"], "ledger": ["a", "b", "c"]}
    for kind in KINDS:
        table = open_table(root, kind)
        assert table.version() == versions[kind] + 1
        assert [u.rsplit("/", 1)[1] for u in table.file_uris()] == [second[kind][0]["path"].rsplit("/", 1)[1]]
    # Publishing it again (a manifest write after a kill) changes nothing.
    assert publish(root, "j", "p", 2, second)
    assert {kind: open_table(root, kind).version() for kind in KINDS} == {k: v + 1 for k, v in versions.items()}


def test_a_late_publish_of_an_older_commit_keeps_the_newer_one(tmp_path):
    """Worker A committed (epoch 1) and stalled before its tables' transactions; a forced rerun committed
    epoch 2 and published; A's publish then arrives late. It must neither replace nor add to epoch 2."""
    out = str(tmp_path / "out")
    root = storage.resolve(out)
    old, new = staged(root, "p", ["a"], 1), staged(root, "p", ["a", "b"], 2)
    assert publish(root, "j", "p", 2, new)
    assert not publish(root, "j", "p", 1, old)
    assert seen(out) == {"outputs": ["a", "b"], "ledger": ["a", "b"]}
    assert all(open_table(root, kind).transaction_version("j/p") == 2 for kind in KINDS)


def publish_in_process(out: str, storage_config, commit: tuple[str, int, dict], barrier, results) -> None:
    """One committer in its own interpreter, as a worker process is: publishes once every committer is ready."""
    partition, epoch, files = commit
    try:
        barrier.wait(timeout=60)
        results.put((partition, epoch, publish(storage.resolve(out, storage_config), "j", partition, epoch, files)))
    except Exception as e:  # reported to the test, which names it
        results.put((partition, epoch, f"{type(e).__name__}: {str(e)[:300]}"))


def race(out: str, storage_config, commits: list[tuple[str, list[str], int]]) -> list:
    """Publish each (partition, ids, epoch) from its own process, all started together. Processes, not
    threads: a process keeps its tables open and takes turns between its own publishes of a table, so only
    committers in different processes meet in the Delta log, as workers on different machines do."""
    root = storage.resolve(out, storage_config)
    ready = [(p, epoch, staged(root, p, ids, epoch)) for p, ids, epoch in commits]
    ctx = multiprocessing.get_context("spawn")  # fresh interpreters, like two worker processes
    barrier, results = ctx.Barrier(len(commits)), ctx.Queue()
    runners = [ctx.Process(target=publish_in_process, args=(out, storage_config, c, barrier, results)) for c in ready]
    for r in runners:
        r.start()
    got = {(p, epoch): result for p, epoch, result in (results.get(timeout=180) for _ in runners)}
    for r in runners:
        r.join(timeout=60)
    return [got[(p, epoch)] for p, _, epoch in commits]


def check_race(out: str, storage_config=None) -> None:
    root = storage.resolve(out, storage_config)
    # This process publishes first: its tables are open before the other processes' commits land.
    assert publish(root, "j", "p0", 1, staged(root, "p0", ["0"], 1))
    # Two workers commit different partitions at once: both land, each once.
    assert race(out, storage_config, [("p1", ["a", "b"], 1), ("p2", ["c"], 1)]) == [True, True]
    assert seen(out, storage_config) == {"outputs": ["0", "a", "b", "c"], "ledger": ["0", "a", "b", "c"]}
    # A fenced worker (epoch 1) and the claim that took over (epoch 2) publish the same partition at once:
    # the newer claim's rows are there, once, whichever came first.
    assert race(out, storage_config, [("p3", ["old"], 1), ("p3", ["new", "new2"], 2)])[1] is True
    assert seen(out, storage_config)["ledger"] == ["0", "a", "b", "c", "new", "new2"]
    # The fenced worker comes back later still, in this process (its tables read the others' commits in):
    # nothing changes.
    assert not publish(root, "j", "p3", 1, staged(root, "p3", ["late"], 1))
    assert seen(out, storage_config)["outputs"] == ["0", "a", "b", "c", "new", "new2"]
    assert all(open_table(root, kind).transaction_version("j/p3") == 2 for kind in KINDS)


def test_concurrent_committers_on_a_local_folder(tmp_path):
    check_race(str(tmp_path / "out"))


def test_concurrent_committers_on_s3(s3_server, s3_client):
    s3_client.create_bucket(Bucket="tables")
    check_race("s3://tables/out", StorageConfig(s3_endpoint_url=s3_server, s3_region="us-east-1"))


def test_a_table_deleted_under_a_running_process_is_read_anew(tmp_path):
    """A process keeps its tables open between publishes; a root deleted and its tables made again in the
    meantime must be read anew: the partition's rows the new table holds are replaced, not those the deleted
    one held (which would leave both the old rows and the new in the table)."""
    out = tmp_path / "out"
    root = storage.resolve(str(out))
    assert publish(root, "j", "p", 1, staged(root, "p", ["a"], 1))
    assert publish(root, "j", "q", 1, staged(root, "q", ["c"], 1))  # its tables here hold version 1: p's files
    shutil.rmtree(out)
    other = partition_tables("p", ["x"])
    for kind in KINDS:  # made again by another process, up to the version held here (a file of the same name)
        DeltaTable.create(str(out / kind), SCHEMAS[kind], partition_by=["job_id", "partition"])
        write_deltalake(str(out / kind), other[kind], mode="append")
        assert open_table(root, kind).version() == 1
    assert publish(root, "j", "p", 2, staged(root, "p", ["b"], 2))
    assert seen(str(out)) == {"outputs": ["b"], "ledger": ["b"]}


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


def test_maintain_deletes_the_staged_files_of_an_attempt_never_published(tmp_path):
    """A fenced or killed attempt staged its files and never published them: no log names them, and `tables
    maintain` deletes them once past the retention, while the published partition's rows stay."""
    from pipeline.output.tables import maintain

    out = str(tmp_path / "out")
    root = storage.resolve(out)
    assert publish(root, "j", "p", 2, staged(root, "p", ["a"], 2))
    orphan = staged(root, "p", ["late"], 1)  # the fenced-out worker's files, never published
    paths = [root.join(kind, f["path"]) for kind, files in orphan.items() for f in files]
    assert all(root.fs.get_file_info(p).type == pafs.FileType.File for p in paths)
    maintain(root, retention_hours=0, target_mb=64)
    assert all(root.fs.get_file_info(p).type == pafs.FileType.NotFound for p in paths)
    assert seen(out) == {"outputs": ["a"], "ledger": ["a"]}
