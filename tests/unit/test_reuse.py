"""Near-duplicate and semantic reuse, the meaning guards, tenant scopes and shadow verification (no engine)."""

import random

import numpy as np
import pyarrow as pa
import pytest

from pipeline.config import DedupConfig, PromptConfig, SamplingConfig, TierConfig
from pipeline.dedup import guards, minhash
from pipeline.dedup.cluster import add_content_hashes, cluster_records, shadow_selected
from pipeline.generate.reuse import generations_for, resolve
from pipeline.generate.shadow import summarise_verification, token_f1, wilson_interval
from pipeline.keys import normalise_text

BASE = (
    "Acme Corp reported quarterly revenue of 120 million dollars, up from last year. The board approved a new "
    "dividend and the chief executive said demand for the company's industrial pumps remained strong across "
    "Europe and Asia. Analysts expect growth to continue into the next fiscal year as new plants open in Ohio."
)


def keyed(rows, config: DedupConfig, partitions=None):
    table = pa.table(
        {
            "id": [r[0] for r in rows],
            "tenant": [r[1] for r in rows],
            "text": [r[2] for r in rows],
            "partition": partitions or ["p0"] * len(rows),
            "tier": ["small"] * len(rows),
        }
    )
    from pipeline.keys import add_item_keys

    return add_item_keys(
        add_content_hashes(table, config),
        PromptConfig(),
        SamplingConfig(),
        {"small": TierConfig(model="m", price_per_gpu_hour=1.0)},
    )


def reuse_of(rows, config=None, embedder=None, partitions=None):
    config = config or DedupConfig(shadow_rate=0.0)
    out, stats = cluster_records(keyed(rows, config, partitions), config, embedder)
    return {r["id"]: (r["reuse"], r["gen_id"]) for r in out.to_pylist()}, out, stats


def test_minhash_estimates_jaccard_and_lsh_finds_close_pairs():
    a = " ".join(f"w{i}" for i in range(300))
    b = " ".join(f"w{i}" for i in range(30, 330))  # 270 of 330 distinct 1-shingles shared
    sa, sb = minhash.signature(a, 1, 256), minhash.signature(b, 1, 256)
    assert abs(minhash.jaccard(sa, sb) - 270 / 330) < 0.08
    assert (minhash.signature(a) == minhash.signature(a)).all()
    index = minhash.LshIndex(0.8, 128)
    index.add(7, minhash.signature(a))
    assert index.candidates(minhash.signature(a + " one more")) == [7]
    assert index.candidates(minhash.signature("entirely different words here and there " * 5)) == []
    bands, rows = minhash.bands_for(0.8, 128)
    assert bands * rows <= 128 and 0.5 < (1 / bands) ** (1 / rows) < 0.9  # S-curve midpoint below the threshold


def test_minhash_signatures_do_not_depend_on_the_batch_and_estimate_jaccard_without_bias():
    rng = random.Random(3)
    vocabulary = [f"v{i}" for i in range(400)]
    texts = [" ".join(rng.choice(vocabulary) for _ in range(rng.randint(0, 300))) for _ in range(60)] + [
        "",
        "one",
        "a b",
    ]
    together = minhash.signatures(texts)
    assert all((minhash.signature(t) == together[i]).all() for i, t in enumerate(texts))
    assert (minhash.signatures(texts, 5, 128) == minhash.signatures(texts[::-1], 5, 128)[::-1]).all()
    errors = []
    for t in texts[:50]:
        words = t.split()
        if len(words) < 50:
            continue
        changed = list(words)
        for _ in range(rng.randint(1, 20)):
            changed[rng.randrange(len(changed))] = f"x{rng.random()}"
        shingles = [{tuple(w[i : i + 5]) for i in range(len(w) - 4)} for w in (words, changed)]
        truth = len(shingles[0] & shingles[1]) / len(shingles[0] | shingles[1])
        errors.append(minhash.jaccard(minhash.signature(t), minhash.signature(" ".join(changed))) - truth)
    assert abs(np.mean(errors)) < 0.02 and np.std(errors) < 0.07


def test_static_embeddings_are_model2vec_means_whatever_the_batch(static_embedder):
    from pipeline.dedup.embed import StaticEmbedder

    embedder = StaticEmbedder(static_embedder)
    long = " ".join(["alpha"] * 512 + ["beta"] * 188)
    texts = [BASE, "Héllo wörld, it's 3.5% — ok?", "", long, "short"]
    together = embedder.encode(texts)
    alone = np.vstack([embedder.encode([t]) for t in texts])
    assert np.allclose(together, alone, atol=1e-6), "a text's embedding must not depend on its batch"
    # model2vec's own (weighted) mean over the same tokens
    reference = np.asarray(embedder.model.encode(texts[:2] + texts[4:], use_multiprocessing=False), np.float32)
    reference /= np.linalg.norm(reference, axis=1, keepdims=True)
    assert np.allclose(together[[0, 1, 4]], reference, atol=1e-5)
    assert not together[2].any(), "an empty text has no direction"
    assert np.allclose(together[3], embedder.encode(["alpha"])[0], atol=1e-6), "words past max_tokens are not counted"


@pytest.mark.parametrize(
    "changed, guard",
    [
        (BASE.replace("approved", "did not approve"), "negation"),
        (BASE.replace("120", "150"), "numbers"),
        (BASE.replace("Europe and Asia", "Africa and Asia"), "entities"),
        (BASE + " " + BASE, "length"),
    ],
)
def test_guards_refuse_changed_meaning(changed, guard):
    assert guards.texts_agree(BASE, changed, 1.5) == guard


def test_guards_let_headers_footers_and_whitespace_through():
    assert (
        guards.texts_agree(BASE, "Fwd: Forwarded message from Dana Smith, 3 May. " + BASE + " Sent from my phone", 1.5)
        is None
    )
    assert guards.texts_agree(BASE, normalise_text(BASE.replace(" ", "   ")), 1.5) is None
    assert guards.texts_agree(BASE, "NOT FOR DISTRIBUTION. " + BASE, 1.5) == "negation", (
        "an added 'not' is never boilerplate"
    )


def test_near_duplicates_reuse_and_changed_meaning_does_not():
    got, _, stats = reuse_of(
        [
            ("a", "t1", BASE),
            ("b", "t1", "Fwd: " + BASE + " Sent from my phone"),
            ("c", "t1", BASE.replace("approved", "did not approve")),
            ("d", "t1", BASE.replace("120", "150")),
            ("e", "t1", "  " + BASE.replace(" ", "  ")),
        ]
    )
    assert got == {
        "a": (None, None),
        "b": ("near_duplicate", "a"),
        "c": (None, None),
        "d": (None, None),
        "e": (None, None),
    }  # e is an exact duplicate: same key, no near/semantic kind
    assert stats.refused["numbers"] >= 1  # similar enough to be a candidate; the guard said no


def test_no_reuse_across_tenants_unless_shared():
    rows = [("a", "t1", BASE), ("b", "t2", "Fwd: " + BASE), ("c", "t2", BASE)]
    got, out, _ = reuse_of(rows)
    assert got == {"a": (None, None), "b": (None, None), "c": ("near_duplicate", "b")}, "t2 reuses only t2's"
    assert len(set(out["item_key"].to_pylist())) == 3
    shared = DedupConfig(shadow_rate=0.0, shared_tenants=["t1", "t2"])
    got, out, _ = reuse_of(rows, shared)
    assert got["b"] == ("near_duplicate", "a")
    assert out["item_key"][0].as_py() == out["item_key"][2].as_py(), "shared tenants share exact outputs too"


def test_guards_off_reuse_even_changed_numbers():
    got, _, _ = reuse_of(
        [("a", "t", BASE), ("b", "t", BASE.replace("120", "150"))],
        DedupConfig(shadow_rate=0.0, guards=False, near_threshold=0.5),
    )
    assert got["b"] == ("near_duplicate", "a")


def test_representative_in_another_partition_travels_with_its_member():
    _, out, _ = reuse_of([("a", "t", BASE), ("b", "t", "Fwd: " + BASE)], partitions=["p0", "p1"])
    member = out.to_pylist()[1]
    assert member["gen_id"] == "a" and member["gen_text"] == BASE
    units = generations_for(out.filter(pa.compute.equal(out["partition"], "p1")), {member["gen_key"]})
    assert units.to_pylist() == [
        {
            "id": "a",
            "text": BASE,
            "tenant": "t",
            "scope": "t=t",
            "tier": "small",
            "item_key": member["gen_key"],
            "request": None,
        }
    ]


def test_missing_cache_target_falls_back_to_generating():
    _, out, _ = reuse_of([("a", "t", BASE)])
    out = out.set_column(out.schema.get_field_index("gen_key"), "gen_key", pa.array(["cached-key"]))
    out = out.set_column(out.schema.get_field_index("reuse"), "reuse", pa.array(["cache_near"]))
    assert resolve(out, {"cached-key"})["gen_key"].to_pylist() == ["cached-key"]
    fallen = resolve(out, set())
    assert fallen["gen_key"].to_pylist() == out["item_key"].to_pylist() and fallen["reuse"].to_pylist() == [None]


def test_semantic_reuse_of_a_paraphrase_with_guards(static_embedder):
    from pipeline.dedup.embed import StaticEmbedder

    paraphrase = (
        "Acme Corp said its quarterly revenue was 120 million dollars, higher than last year. The board "
        "approved a new dividend, and the chief executive said demand for the company's industrial pumps "
        "stayed strong in Europe and Asia. Analysts expect more growth next fiscal year as new plants open in Ohio."
    )
    embedder = StaticEmbedder(static_embedder)
    v = embedder.encode([BASE, paraphrase, "The weather in Paris was sunny all week."])
    assert v.shape[0] == 3 and np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    config = DedupConfig(shadow_rate=0.0, near=False, semantic=True, semantic_threshold=0.85)
    got, out, _ = reuse_of(
        [("a", "t", BASE), ("b", "t", paraphrase), ("c", "t", paraphrase.replace("120", "90")), ("d", "u", paraphrase)],
        config,
        embedder,
    )
    assert got == {"a": (None, None), "b": ("semantic", "a"), "c": (None, None), "d": (None, None)}
    assert out["similarity"][1].as_py() >= 0.85


def test_shadow_sample_is_deterministic_and_sized():
    keys = [f"key-{i}" for i in range(20_000)]
    picked = [k for k in keys if shadow_selected(k, 0.1)]
    assert 1_700 < len(picked) < 2_300
    assert picked == [k for k in keys if shadow_selected(k, 0.1)]
    assert not any(shadow_selected(k, 0.0) for k in keys[:100])


def test_verification_arithmetic():
    assert token_f1("the cat sat", "the cat sat") == 1.0
    assert token_f1("a b", "c d") == 0.0
    assert token_f1("a b c d", "a b") == pytest.approx(2 * 1.0 * 0.5 / 1.5)
    low, high = wilson_interval(0, 20)
    assert low == 0.0 and 0.1 < high < 0.2
    low, high = wilson_interval(5, 100)
    assert low < 0.05 < high
    total = summarise_verification(
        [
            {"by_kind": {"near_duplicate": {"checked": 10, "false_hits": 1}}},
            {
                "by_kind": {
                    "near_duplicate": {"checked": 10, "false_hits": 0},
                    "semantic": {"checked": 5, "false_hits": 2},
                }
            },
        ],
        0.5,
    )
    assert total["checked"] == 25 and total["false_hits"] == 3 and total["false_hit_rate"] == 0.12
    assert total["by_kind"]["semantic"]["false_hit_rate"] == 0.4


def test_a_copy_may_reuse_a_larger_tier_never_a_smaller_one():
    from pipeline.keys import add_item_keys

    config = DedupConfig(shadow_rate=0.0)
    table = pa.table(
        {
            "id": ["big", "copy", "small", "copy-up"],
            "tenant": ["t"] * 4,
            "text": [BASE, "Fwd: " + BASE, BASE.replace("Ohio", "Texas"), "Fwd: " + BASE.replace("Ohio", "Texas")],
            "partition": ["p0"] * 4,
            "tier": ["large", "small", "small", "large"],
        }
    )
    tiers = {
        "small": TierConfig(model="s", price_per_gpu_hour=1.0),
        "large": TierConfig(model="l", price_per_gpu_hour=4.0),
    }
    keyed_table = add_item_keys(add_content_hashes(table, config), PromptConfig(), SamplingConfig(), tiers)
    out, _ = cluster_records(keyed_table, config, None, None, {"small": 1.0, "large": 4.0})
    rows = {r["id"]: r for r in out.to_pylist()}
    assert rows["copy"]["reuse"] == "near_duplicate" and rows["copy"]["gen_id"] == "big"
    assert rows["copy"]["gen_tier"] == "large" and rows["copy"]["gen_key"] == rows["big"]["item_key"]
    assert rows["copy-up"]["reuse"] is None, "a large-tier item never gets a small-tier output"
    # ... so the later large-tier copy represents the pair and the earlier small one reuses it: one generation.
    assert rows["small"]["reuse"] == "near_duplicate" and rows["small"]["gen_id"] == "copy-up"
    assert rows["small"]["gen_tier"] == "large"
    same_tier_only, _ = cluster_records(keyed_table, config, None, None, None)
    assert same_tier_only.to_pylist()[1]["reuse"] is None and same_tier_only.to_pylist()[2]["reuse"] is None
