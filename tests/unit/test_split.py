"""Cutting a tenant scope too large for one planning process (pipeline/dedup/split.py, planning.shard_rows):
near duplicates and exact copies never end up in different parts, parts are balanced, and a plan whose
scopes are cut stages what an uncut plan stages, but for the semantic matches across parts, counted."""

from __future__ import annotations

import json
import random

import numpy as np
import pyarrow as pa
import pytest

from pipeline.dedup import minhash, split
from pipeline.dedup.minhash import band_hashes, bands_for, signatures
from pipeline.dev.samples import synthetic_document
from pipeline.plan.streamed import plan_job
from pipeline.stores import storage
from pipeline.stores.staging import StagingArea


def test_components_join_rows_sharing_any_band_and_nothing_else():
    hashes = np.array([[1, 10], [2, 10], [2, 20], [3, 30], [4, 40], [3, 41]], np.uint64)
    # rows 0-1 share band 1, rows 1-2 band 0: one component; rows 3 and 5 share band 0; row 4 alone
    c = split.components(hashes)
    assert c[0] == c[1] == c[2] and c[3] == c[5] and len({c[0], c[3], c[4]}) == 3


def test_parts_keep_components_whole_and_balance_rows():
    rng = np.random.default_rng(0)
    component = np.concatenate([np.full(30, 0), np.full(12, 1), np.arange(2, 60)])  # two groups and singles
    rng.shuffle(component)
    part = split.parts(component, 3)
    for c in np.unique(component):
        assert len(set(part[component == c].tolist())) == 1  # never split
    counts = np.bincount(part, minlength=3)
    assert counts.sum() == len(component) and counts.max() - counts.min() <= 30  # within the largest component
    assert (split.parts(component, 3) == part).all()  # deterministic


def test_near_duplicates_always_share_a_part():
    """Every pair the near pass would compare (a shared LSH bucket) lands in one part."""
    rng = random.Random(4)
    texts = [synthetic_document(rng, 12) for _ in range(300)]
    texts += [t + " Thanks." for t in texts[:100]] + texts[100:150]  # near copies and exact copies
    sigs = signatures(texts, 5, 128)
    hashes = band_hashes(sigs, *bands_for(0.8, 128))
    part = split.parts(split.components(hashes), 4)
    buckets = minhash.LshBuckets(sigs, 0.8, 128)
    for i in range(len(texts)):
        for g in buckets.shared(i):
            assert len(set(part[np.flatnonzero((buckets.groups == g).any(axis=1))].tolist())) == 1
    assert len(set(part.tolist())) == 4


@pytest.mark.parametrize(
    "dedup", [{}, {"dedup__near": False}, {"dedup__semantic": False}], ids=["near+semantic", "near off", "semantic off"]
)
def test_a_cut_scope_stages_what_the_uncut_one_does_but_semantic_matches_across_parts(make_config, tmp_path, dedup):
    """One tenant, cut into parts of about 40 records: exact and near reuse exactly as uncut (near off: parts
    by item key); a row whose decision differs is a semantic match that the cut separated, or a member whose
    cluster a semantic match had promoted. Every record, bad ones included, still ends in one place."""
    rng = random.Random(11)
    base = [synthetic_document(rng, 10) for _ in range(90)]
    docs = base + [t + " Thanks." for t in base[:30]] + base[30:45]  # near copies, exact copies
    docs += [". ".join(reversed(t.split(". "))) for t in base[45:60]]  # reordered: semantic neighbours
    order = list(range(len(docs)))
    rng.shuffle(order)
    root = tmp_path / "input"
    root.mkdir()
    with open(root / "one.jsonl", "w") as f:
        for n, i in enumerate(order):
            f.write(json.dumps({"id": f"d{n}", "text": docs[i], "tenant": "acme"}) + "\n")
            if n % 50 == 7:
                f.write('{"id": "broken", "text": \n')  # a bad line now and then
        f.write(json.dumps({"id": "d3", "text": "a taken id", "tenant": "acme"}) + "\n")

    def staged(shard_rows: int, name: str):
        config = make_config(
            root, input__records_per_partition=25, planning__shard_rows=shard_rows, dedup__shadow_rate=0, **dedup
        )
        area = StagingArea(storage.resolve(str(tmp_path / name)), "cut")
        plan = plan_job(config, "cut", area, workers=1)
        records = pa.concat_tables([area.records(p) for p in plan.partitions]).sort_by("id")
        quarantined = sum(area.quarantine(p).num_rows for p in plan.partitions)
        assert records.num_rows + quarantined == plan.records == len(docs) + 4  # 3 bad lines, 1 taken id
        return records, plan

    whole, plan1 = staged(1_000_000, "whole")
    cut, plan4 = staged(40, "cut")
    assert plan1.shards == 1 and not plan1.cut
    assert len(plan4.cut["t=acme"]) == 4 and plan4.shards == 4 and sum(plan4.cut["t=acme"]) == whole.num_rows + 1
    assert cut["id"] == whole["id"] and cut["item_key"] == whole["item_key"]
    kinds = whole["reuse"].to_pylist(), cut["reuse"].to_pylist()
    assert kinds[0].count("near_duplicate") == kinds[1].count("near_duplicate")
    assert (
        kinds[0].count("near_duplicate") > 20
        if dedup.get("dedup__near", True)
        else not kinds[0].count("near_duplicate")
    )
    semantic_on = dedup.get("dedup__semantic", True)
    assert (kinds[0].count("semantic") >= 5) == semantic_on
    changed = [
        i
        for i, (a, b) in enumerate(zip(whole.to_pylist(), cut.to_pylist()))
        if (a["gen_key"], a["reuse"]) != (b["gen_key"], b["reuse"])
    ]
    ids, gen_ids = whole["id"].to_pylist(), whole["gen_id"].to_pylist()
    for i in changed:
        assert semantic_on and (
            "semantic" in (kinds[0][i], kinds[1][i])
            or kinds[0][i] == kinds[1][i] == "near_duplicate"
            or (gen_ids[i] and kinds[0][ids.index(gen_ids[i])] == "semantic")
        ), (ids[i], kinds[0][i], kinds[1][i])
    print(
        f"{dedup}: rows staged differently with the scope cut: {len(changed)} of {kinds[0].count('semantic')} semantic"
    )


def test_a_cut_scope_counts_its_cache_index_once():
    """Every part of a cut scope searches the scope's whole cache index: merged, the manifest counts it once."""
    from pipeline.dedup.cluster import DedupStats

    total = DedupStats()
    for part in (DedupStats(cache_index={"t=acme": 120}), DedupStats(cache_index={"t=acme": 120, "t=beta": 7})):
        total.merge(part)
    assert total.cache_index == {"t=acme": 120, "t=beta": 7}
