import pyarrow as pa

from pipeline.config import DedupConfig, RouteConfig
from pipeline.dedup.cluster import add_content_hashes, mark_duplicates
from pipeline.keys import content_hash, normalise_text
from pipeline.route.rules import assign_tiers


def records(rows):
    return pa.table({"id": [r[0] for r in rows], "tenant": [r[1] for r in rows], "text": [r[2] for r in rows]})


def test_normalisation_nfc_and_whitespace():
    assert normalise_text("  cafe\u0301 \n\t au  lait ") == "caf\u00e9 au lait"
    assert normalise_text("ABC", case_fold=True) == "abc"


def test_exact_duplicates_within_a_tenant_reuse_the_first():
    out = mark_duplicates(add_content_hashes(records([("a", "t1", "Hello  world"), ("b", "t1", "Hello world\n"),
                                   ("c", "t2", "Hello world"), ("d", "t1", "hello world")]), DedupConfig()), "content_hash")
    assert out["duplicate_of"].to_pylist() == [None, "a", None, None]
    assert content_hash("t1", "x") != content_hash("t2", "x")


def test_case_fold_and_disabled():
    rows = records([("a", "t", "Hello"), ("b", "t", "hello")])

    def dups(config):
        return mark_duplicates(add_content_hashes(rows, config), "content_hash")["duplicate_of"].to_pylist()

    assert dups(DedupConfig(case_fold=True)) == [None, "a"]
    assert dups(DedupConfig(case_fold=False)) == [None, None]
    assert dups(DedupConfig(exact=False, case_fold=True)) == [None, None]


def test_route_assigns_the_default_tier():
    out = assign_tiers(records([("a", "t", "x")]), RouteConfig(default_tier="small"))
    assert out["tier"].to_pylist() == ["small"]
