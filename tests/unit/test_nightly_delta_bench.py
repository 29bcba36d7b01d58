"""benchmarks/nightly_delta.py without an engine: night 2 is night 1 with 10% edited, 5% new and 5% removed."""

from __future__ import annotations

import json
import random

from benchmarks import nightly_delta


def test_night_two_changes_what_it_says_and_keeps_the_rest(tmp_path):
    first, second, changed = nightly_delta.nights(200, random.Random(30))
    assert changed == {"edited": 20, "new": 10, "removed": 10} and len(first) == 200 and len(second) == 200
    kept = set(first) & set(second)
    assert len(set(first) - set(second)) == 10 and len(set(second) - set(first)) == 10
    assert sum(first[k] != second[k] for k in kept) == 20  # every edit changed its document
    assert len(set(first.values())) == 200  # night 1 holds no duplicate (its target assumes none)
    path = nightly_delta.write_night(tmp_path / "n2", second, 64)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["custom_id"] for line in lines] == list(second)
    assert {line["body"]["max_tokens"] for line in lines} == {64}
