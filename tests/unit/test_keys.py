"""Content addresses are unambiguous: no two different (tenant, text, id, recipe, derivation) ever share a key."""

import pyarrow as pa

from pipeline.config import DedupConfig, PromptConfig, SamplingConfig, TierConfig
from pipeline.dedup.cluster import add_content_hashes
from pipeline.keys import add_item_keys, content_hash, derived_key, item_key, key_bytes, tenant_scope
from tests.unit.test_dedup_route import mark_duplicates

TIERS = {"small": TierConfig(model="m", price_per_gpu_hour=1.0)}


def keyed(rows, config=DedupConfig()):
    table = pa.table(
        {
            "id": [r[0] for r in rows],
            "tenant": [r[1] for r in rows],
            "text": [r[2] for r in rows],
            "tier": ["small"] * len(rows),
        }
    )
    return add_item_keys(add_content_hashes(table, config), PromptConfig(), SamplingConfig(), TIERS)


def test_a_nul_in_the_tenant_or_the_text_never_makes_two_tenants_share_a_key():
    # Joined with a NUL, tenant "a\0b" + text "c" and tenant "a" + text "b\0c" were the same bytes.
    out = mark_duplicates(keyed([("1", "a\x00b", "c"), ("2", "a", "b\x00c")]), "content_hash")
    assert out["content_hash"][0] != out["content_hash"][1]
    assert out["item_key"][0] != out["item_key"][1]
    assert out["duplicate_of"].to_pylist() == [None, None], "one tenant must never get the other's output"
    assert content_hash(tenant_scope("a\x00b", set()), "c") != content_hash(tenant_scope("a", set()), "b\x00c")


def test_with_exact_dedup_off_the_id_cannot_borrow_from_the_text():
    config = DedupConfig(exact=False)
    out = keyed([("x\x00y", "t", "z"), ("x", "t", "y\x00z"), ("x", "t\x00x", "z")], config)
    assert len(set(out["content_hash"].to_pylist())) == 3


def test_scopes_are_distinct_for_every_tenant_name():
    shared = {"pub"}
    tenants = ["shared", "pub", "t=x", "x", "", "acme", "acme:x", "*"]
    scopes = [tenant_scope(t, shared) for t in tenants]
    # "pub" is the one shared tenant: only it maps to the shared scope, never a tenant literally named "shared".
    assert scopes.count(tenant_scope("pub", shared)) == 1
    assert len(set(scopes)) == len(tenants)


def test_item_and_derived_keys_cannot_be_confused_by_their_separators():
    assert item_key("a:b", "c") != item_key("a", "b:c")
    assert derived_key("a>b", "c", "d") != derived_key("a", "b>c", "d")
    assert derived_key("a", "b", "c>d") != derived_key("a", "b>c", "d")
    assert derived_key("k", "chunk", 1) != derived_key("k", "chunk", 2)


def test_key_bytes_is_injective_on_part_lists():
    lists = [
        ("ab", "c"),
        ("a", "bc"),
        ("abc",),
        ("abc", ""),
        ("", "abc"),
        ("1:a", ""),
        ("1", ":a"),
        ("a\x00b",),
        ("a", "b"),
        ("\u00e9", "x"),
        ("\u00e9x",),
    ]
    assert len({key_bytes(*parts) for parts in lists}) == len(lists)


def test_item_keys_are_stable_for_equal_inputs():
    a, b = keyed([("1", "t", "Hello  world")]), keyed([("2", "t", "Hello world")])
    assert a["item_key"][0] == b["item_key"][0]


def test_loop_knobs_change_keys_only_when_set():
    """The sampling knobs against loops are part of the item key, but keys made before they existed stay valid:
    the default config's recipe is the one 1c8a768 (before the knobs) computed."""
    from pipeline.config import PromptConfig, SamplingConfig
    from pipeline.keys import recipe_hash

    prompt = PromptConfig()
    assert recipe_hash("m", prompt, SamplingConfig()) == "7e08f46b61697e19"
    for knob in (
        {"repetition_penalty": 1.2},
        {"frequency_penalty": 0.5},
        {"presence_penalty": 0.5},
        {"min_tokens": 8},
        {"stop": ["\n\n"]},
    ):
        assert recipe_hash("m", prompt, SamplingConfig(**knob)) != "7e08f46b61697e19", knob
