"""The staging area (stores/staging.py): what a job staged before batch requests were typed columns is refused
by name, never read as something else."""

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
