"""The staging area (stores/staging.py): what older versions wrote there is still read."""

from __future__ import annotations

import json

import pyarrow as pa

from pipeline.stores import storage
from pipeline.stores.staging import StagingArea


def test_a_wave_file_written_with_the_old_unit_column_reads_as_generation(tmp_path):
    area = StagingArea(storage.resolve(str(tmp_path)), "job")
    generation = json.dumps({"item_key": "k", "id": "r1", "tenant": "t", "scope": "t=t", "tier": "small", "text": "x"})
    old = pa.table({"id": ["r1"], "item_key": ["k"], "unit": [generation]})  # the column's name before the rename
    area.write_wave("p", 0, "token", "small", old)
    table = area.wave("p", 0, "token", "small")
    assert table.column_names == ["id", "item_key", "generation"]
    assert json.loads(table["generation"][0].as_py())["id"] == "r1"
    new = pa.table({"id": ["r1"], "item_key": ["k"], "generation": [generation]})
    area.write_wave("p", 1, "token", "small", new)
    assert area.wave("p", 1, "token", "small").equals(new)
