import pyarrow as pa

from pipeline.config import DedupConfig, RouteConfig
from pipeline.dedup.cluster import add_content_hashes
from pipeline.keys import content_hash, normalise_text
from pipeline.route.rules import assign_tiers


def mark_duplicates(records: pa.Table, key: str) -> pa.Table:  # exact duplicates by content hash, as keys make them
    """Add `duplicate_of`: the id of the first record with the same `key`, null for that first record."""
    duplicate_of: list[str | None] = []
    first: dict[str, str] = {}
    for id_, k in zip(records["id"].to_pylist(), records[key].to_pylist()):
        duplicate_of.append(first.get(k))
        first.setdefault(k, id_)
    return records.append_column("duplicate_of", pa.array(duplicate_of, pa.string()))


def records(rows):
    return pa.table({"id": [r[0] for r in rows], "tenant": [r[1] for r in rows], "text": [r[2] for r in rows]})


def test_normalisation_nfc_and_whitespace():
    assert normalise_text("  cafe\u0301 \n\t au  lait ") == "caf\u00e9 au lait"
    assert normalise_text("ABC", case_fold=True) == "abc"


def test_exact_duplicates_within_a_tenant_reuse_the_first():
    out = mark_duplicates(
        add_content_hashes(
            records(
                [
                    ("a", "t1", "Hello  world"),
                    ("b", "t1", "Hello world\n"),
                    ("c", "t2", "Hello world"),
                    ("d", "t1", "hello world"),
                ]
            ),
            DedupConfig(),
        ),
        "content_hash",
    )
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
