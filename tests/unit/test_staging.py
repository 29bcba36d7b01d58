"""The staging area (stores/staging.py): what a job staged before batch requests were typed columns is read as
typed where it holds no request (a document job), and a batch job's JSON requests are refused by name, never read
as something else."""

import pyarrow as pa
import pytest

from pipeline.schema import REQUEST
from pipeline.stores import storage
from pipeline.stores.staging import StagingArea


def test_records_staged_with_requests_as_json_text_are_refused_with_what_to_do(tmp_path):
    area = StagingArea(storage.resolve(str(tmp_path)), "old-job")
    old = pa.table({"id": ["r1"], "request": ['{"format":"openai"}']})
    area.write_staged("p-0", old, pa.table({"id": pa.array([], pa.string())}))
    with pytest.raises(storage.StorageError, match="job old-job was planned by an earlier tokenmill.*new job"):
        area.records("p-0")
    assert area.quarantine("p-0").num_rows == 0  # files without requests read as ever


def test_records_staged_with_typed_requests_read_back_as_staged(tmp_path):
    area = StagingArea(storage.resolve(str(tmp_path)), "job")
    request = {"format": "openai", "endpoint": "/v1/completions", "model": "m", "messages": None, "document": None}
    records = pa.table({"id": ["r1", "d1"], "request": pa.array([request, None], REQUEST)})
    area.write_staged("p-0", records, records.slice(0, 0))
    assert area.records("p-0").equals(records)


def test_a_wave_files_generations_read_back_as_derived_and_an_unknown_field_is_refused():
    from pipeline.generate.partition_waves import read_generation, wave_generations

    request = {"format": "openai", "endpoint": "/v1/completions", "model": "m", "messages": None, "document": None}
    chunk = {"id": "d\x00chunk0", "text": "piece", "tenant": "t", "scope": None, "tier": "small", "item_key": "k1"}
    chunk |= {"request": request, "record_id": "d"}
    judge = {"id": "d", "text": "rubric", "tenant": "t", "scope": "s", "tier": "large", "item_key": "k2"}
    judge |= {"request": None, "judge": True, "max_tokens": 4}
    column = wave_generations([chunk, judge])
    chunk_back, judge_back = (read_generation(v) for v in column.to_pylist())
    assert judge_back == judge and "document" not in chunk_back
    assert {k: v for k, v in chunk_back.items() if k != "request"} == {k: v for k, v in chunk.items() if k != "request"}
    assert chunk_back["request"]["endpoint"] == "/v1/completions" and chunk_back["request"]["params"] is None
    with pytest.raises(ValueError, match="pieces"):
        wave_generations([{**judge, "pieces": 3}])


def test_a_document_job_staged_before_typed_requests_reads_its_null_request_column_as_typed(tmp_path):
    # As the earlier tokenmill staged every job: a `request` column of JSON text, null for a document.
    area = StagingArea(storage.resolve(str(tmp_path)), "old-job")
    old = pa.table({"id": ["d1", "d2"], "text": ["one", "two"], "request": pa.array([None, None], pa.string())})
    area.write_staged("p-0", old, old.slice(0, 0))
    records = area.records("p-0")
    assert records.schema.field("request").type == REQUEST and records["request"].null_count == 2
    assert records.drop_columns(["request"]).equals(old.drop_columns(["request"]))
    assert area.quarantine("p-0").schema.field("request").type == REQUEST


def test_an_old_wave_file_of_json_text_is_read_by_parsing_it_and_refused_only_for_batch_requests(tmp_path):
    import json

    from pipeline.generate.partition_waves import wave_rows

    area = StagingArea(storage.resolve(str(tmp_path)), "old-job")
    document = {"id": "d", "text": "doc", "tenant": "t", "scope": None, "tier": "small", "item_key": "k1"}
    followup = {**document, "item_key": "k2", "retry": True, "max_tokens": 64}

    def old_wave(generations: list[dict]) -> pa.Table:  # as the earlier tokenmill wrote a wave file
        return pa.table(
            {
                "item_key": [g["item_key"] for g in generations],
                "prompt_token_ids": pa.array([[1, 2] for _ in generations], pa.list_(pa.int32())),
                "max_tokens": pa.array([32 for _ in generations], pa.int64()),
                "generation": [json.dumps(g, sort_keys=True) for g in generations],
            }
        )

    area.write_wave("p-0", 0, "tok", "small", old_wave([{**document, "request": None}, {**followup, "request": None}]))
    rows = wave_rows(area, area.wave("p-0", 0, "tok", "small"))
    assert [r["generation"] for r in rows] == [{**document, "request": None}, {**followup, "request": None}]
    assert [r["prompt_token_ids"] for r in rows] == [[1, 2], [1, 2]]
    area.write_wave("p-0", 1, "tok", "small", old_wave([{**document, "request": '{"model":"m"}'}]))
    with pytest.raises(storage.StorageError, match="job old-job was planned by an earlier tokenmill.*new job"):
        wave_rows(area, area.wave("p-0", 1, "tok", "small"))
