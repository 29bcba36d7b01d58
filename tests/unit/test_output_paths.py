"""Every path under an output root is built and read back by one type (stores/paths.py `OutputPath`)."""

import pytest

from pipeline.stores import storage
from pipeline.stores.paths import OutputPath


@pytest.mark.parametrize(
    ("path", "text"),
    [
        (OutputPath.staging("j1"), "_staging/job=j1"),
        (OutputPath.staging("j1", "plan.json"), "_staging/job=j1/plan.json"),
        (OutputPath.staging("j1", "records.parquet", "p-3"), "_staging/job=j1/partition=p-3/records.parquet"),
        (OutputPath.table_file("outputs", "j1", "p-3", "c9"), "outputs/job_id=j1/partition=p-3/part-c9.parquet"),
        (OutputPath.manifest("j1"), "jobs/j1/manifest.json"),
        (OutputPath.batch_result("j1", "in/a.jsonl", "errors"), "batches/job=j1/in/a.jsonl.errors.jsonl"),
        (OutputPath.api("files", "file-1.jsonl"), "_api/files/file-1.jsonl"),
        (OutputPath.api("inputs", "batch-1/input.jsonl"), "_api/inputs/batch-1/input.jsonl"),
    ],
)
def test_each_path_is_built_and_parsed_back(path, text):
    assert str(path) == text
    assert OutputPath.parse(text) == path


def test_a_full_path_is_read_relative_to_its_root(tmp_path):
    root = storage.resolve(str(tmp_path))
    path = OutputPath.manifest("j1")
    assert OutputPath.parse(path.full(root), root) == path
    with pytest.raises(ValueError, match="not under the output root"):
        OutputPath.parse("/elsewhere/jobs/j1/manifest.json", root)


def test_a_table_file_is_named_relative_to_its_table_and_odd_values_become_digests():
    path = OutputPath.table_file("ledger", "j 1", "a/b", "c9")
    job, partition, name = path.in_table().split("/")
    assert job.startswith("job_id=h") and partition.startswith("partition=h") and name == "part-c9.parquet"


def test_the_layout_before_delta_tables_is_told_apart():
    old = OutputPath.parse("outputs/job=j1/partition=p-3/part-0.parquet")
    assert old.old and (old.job, old.partition, old.name) == ("j1", "p-3", "part-0.parquet")
    assert not OutputPath.parse("outputs/job_id=j1/partition=p-3/part-0.parquet").old
    assert not OutputPath.parse("_staging/job=j1").old
