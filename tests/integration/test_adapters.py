"""One LoRA adapter per tenant on a shared base model: keys, isolation and vLLM's mixed-batch bug.

The engine tests serve two demo adapters (`tokenmill models adapter`) in one tiny-small engine."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from pipeline import run_job
from pipeline.config import PromptConfig, SamplingConfig, TierConfig
from pipeline.dedup.cluster import add_content_hashes
from pipeline.generate.adapters import lora_kwargs
from pipeline.generate.engine import EnginePool
from pipeline.keys import adapter_digest, add_item_keys, escalation_key, recipe_hash
from pipeline.stores.catalog import migrate
from tests.conftest import read_kind

TIERS = {"small": TierConfig(model="m-small", price_per_gpu_hour=1.0)}


def tenants(demo_adapters, *names, **extra):
    """Config overrides giving each named tenant its demo adapter."""
    return {**{f"tenants__{n}__adapter": demo_adapters[n] for n in names}, **extra}


def keyed(tenants, adapters, shared=True):
    from pipeline.config import DedupConfig

    table = pa.table(
        {
            "id": [f"r{i}" for i in range(len(tenants))],
            "tenant": tenants,
            "text": ["same text"] * len(tenants),
            "tier": ["small"] * len(tenants),
        }
    )
    table = add_content_hashes(
        table, DedupConfig(shared_tenants=list(set(tenants)) if shared else []), frozenset(adapters)
    )
    return add_item_keys(table, PromptConfig(), SamplingConfig(), TIERS, lambda tenant, tier: adapters.get(tenant))


def test_the_adapter_is_part_of_the_item_key(demo_adapters):
    out = keyed(["acme", "globex", "initech"], {"acme": demo_adapters["acme"], "globex": demo_adapters["globex"]})
    assert len(set(out["item_key"].to_pylist())) == 3  # same text, shared scope: three outputs, one per adapter
    # Tenants with an adapter keep their own scope even when shared: no near match can cross to them.
    assert out["scope"].to_pylist() == ["t=acme", "t=globex", "shared"]
    # Without adapters, keys are what they were before adapters existed.
    plain = keyed(["initech"], {})
    assert plain["recipe"][0].as_py() == recipe_hash("m-small", PromptConfig(), SamplingConfig())
    # Content-addressed: a copy elsewhere keeps its keys; a changed adapter does not.
    assert adapter_digest(demo_adapters["acme"]) != adapter_digest(demo_adapters["globex"])
    assert escalation_key("k", "large", adapter_digest(demo_adapters["acme"])) != escalation_key("k", "large")


def test_one_tenants_keys_change_with_its_adapter_and_its_retraining(demo_adapters, tmp_path):
    """The same tenant and text (one scope): base, adapter, and the adapter retrained in place are three keys."""
    import shutil

    from pipeline.dev.adapters import build_demo_adapter

    folder = str(shutil.copytree(demo_adapters["acme"], tmp_path / "acme"))
    base, adapted = keyed(["acme"], {}, shared=False), keyed(["acme"], {"acme": folder}, shared=False)
    assert base["scope"].to_pylist() == adapted["scope"].to_pylist()  # only the recipe can tell them apart
    assert base["recipe"][0].as_py() != adapted["recipe"][0].as_py()
    build_demo_adapter(tiny_base(demo_adapters), folder, "acme", seed=7)  # retrained in place
    retrained = keyed(["acme"], {"acme": folder}, shared=False)
    assert len({t["item_key"][0].as_py() for t in (base, adapted, retrained)}) == 3


def tiny_base(demo_adapters) -> str:
    return json.loads((__import__("pathlib").Path(demo_adapters["acme"]) / "adapter_config.json").read_text())[
        "base_model_name_or_path"
    ]


def test_near_duplicates_never_cross_between_an_adapter_and_the_base_model():
    """One tenant (one scope), its adapter on the small tier only: a near copy routed to large (base model)
    must not serve the small, adapted record, though large outranks small; nor the other way round."""
    from pipeline.config import DedupConfig
    from pipeline.dedup.cluster import cluster_records

    text = " ".join(f"word{i}" for i in range(200))
    table = pa.table(
        {
            "id": ["x", "x2"],
            "text": [text, text + " extra"],
            "partition": ["p", "p"],
            "tier": ["small", "large"],
            "scope": ["t=acme"] * 2,
            "recipe": ["r-small-acme", "r-large"],
            "item_key": ["k1", "k2"],
            "tenant": ["acme"] * 2,
        }
    )
    config, rank = DedupConfig(semantic=False, shadow_rate=0.0), {"small": 1.0, "large": 10.0}
    crossed, _ = cluster_records(table, config, tier_rank=rank)
    assert crossed["gen_key"].to_pylist() == ["k2", "k2"]  # without adapters the dearer tier's output serves both
    kept, _ = cluster_records(table, config, tier_rank=rank, adapters=["digest-acme", None])
    assert kept["gen_key"].to_pylist() == ["k1", "k2"] and kept["reuse"].to_pylist() == [None, None]


def test_adapter_copy_keeps_its_digest_and_a_missing_one_is_named(demo_adapters, tmp_path):
    import shutil

    copy = shutil.copytree(demo_adapters["acme"], tmp_path / "copy")
    assert adapter_digest(str(copy)) == adapter_digest(demo_adapters["acme"])
    with pytest.raises(FileNotFoundError, match="no adapter_config.json and adapter_model"):
        adapter_digest(str(tmp_path / "nowhere"))


def test_lora_engine_arguments_leave_one_slot_free(demo_adapters):
    kwargs = lora_kwargs(list(demo_adapters.values()))
    assert kwargs["enable_lora"] and kwargs["max_loras"] == 3 and kwargs["max_lora_rank"] == 8


def test_config_places_each_tenants_adapter_on_its_tier(make_config, demo_adapters):
    config = make_config(**tenants(demo_adapters, "acme", "globex", tenants__globex__adapter_tier="small"))
    assert config.adapter("acme", "small") == demo_adapters["acme"]  # default tier
    assert config.adapter("acme", "large") is None and config.adapter("initech", "small") is None
    assert config.tier_adapters() == {"small": sorted(demo_adapters.values())}
    with pytest.raises(ValueError, match=r"tenants.acme.adapter_tier 'huge' is not one of tiers"):
        make_config(**tenants(demo_adapters, "acme", tenants__acme__adapter_tier="huge"))


def test_each_tenant_is_served_its_own_adapter_and_never_anothers_output(make_config, demo_adapters, tmp_path):
    """Three tenants share a dedup scope and send the same documents: with adapters for two of them, each
    tenant pays for its own outputs (none reused across adapters), the ledger names the adapter and the
    digest of the weights that made each output (also when reused from the cache), and a rerun pays nothing."""
    from pipeline.keys import adapter_digest

    (tmp_path / "input").mkdir()
    texts = [
        "The quarterly report shows revenue grew in the north region and costs fell.",
        "Minutes of the board meeting: the safety review passed and hiring resumes in May.",
    ]
    rows = [
        {"id": f"{t}-{i}", "tenant": t, "text": x} for t in ("acme", "globex", "initech") for i, x in enumerate(texts)
    ]
    (tmp_path / "input" / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = make_config(
        **tenants(demo_adapters, "acme", "globex", dedup__shared_tenants=["acme", "globex", "initech"])
    )
    m = run_job(config, job_id="tenants").manifest.as_json()
    assert m["status"] == "succeeded"
    ledger = {r["id"]: r for r in read_kind(tmp_path / "output", "ledger", "tenants").to_pylist() if r["id"]}
    assert all(ledger[r["id"]]["source"] == "generated" for r in rows), "an output crossed adapters"
    digests = {t: adapter_digest(demo_adapters[t]) for t in ("acme", "globex")}
    for r in rows:
        assert ledger[r["id"]]["adapter"] == {"acme": demo_adapters["acme"], "globex": demo_adapters["globex"]}.get(
            r["tenant"]
        )
        assert ledger[r["id"]]["adapter_digest"] == digests.get(r["tenant"])
    outputs = {r["id"]: r["summary"] for r in read_kind(tmp_path / "output", "outputs", "tenants").to_pylist()}
    assert any(outputs[f"acme-{i}"] != outputs[f"initech-{i}"] for i in range(len(texts)))  # the adapter ran
    again = run_job(config, job_id="tenants-again").manifest.as_json()
    assert again["status"] == "succeeded"
    reused = read_kind(tmp_path / "output", "ledger", "tenants-again").to_pylist()
    assert sum(r["cost_usd"] for r in reused if r["kind"] == "output") == 0  # every tenant's own output, reused
    assert {r["id"]: r["adapter_digest"] for r in reused if r["id"]} == {
        r["id"]: digests.get(r["tenant"]) for r in rows
    }


def test_an_adapter_that_cannot_be_served_stops_the_job_before_any_work(make_config, tiny_models, tmp_path):
    """A missing folder, or weights shaped for another base model (built on tiny-large, served on
    tiny-small), are refused when the job opens, each named, before anything is read or started."""
    from pipeline import JobError
    from pipeline.dev.adapters import build_demo_adapter

    other_base = build_demo_adapter(tiny_models / "tiny-large", tmp_path / "large-adapter", "initech")
    config = make_config(tenants__acme__adapter=str(tmp_path / "nowhere"), tenants__initech__adapter=str(other_base))
    with pytest.raises(JobError) as e:
        run_job(config, job_id="refused")
    assert "tenants.acme.adapter" in str(e.value) and "no adapter_config.json" in str(e.value)
    assert "tenants.initech.adapter" in str(e.value) and "another base model than tier small" in str(e.value)
    assert not (tmp_path / "output").exists()  # nothing read, staged or written


def test_a_pool_without_the_tenants_adapters_is_refused(make_config, demo_adapters):
    from pipeline import JobError

    config = make_config(**tenants(demo_adapters, "acme"))
    with pytest.raises(JobError, match=r"adapters=config.tier_adapters\(\)"):
        run_job(config, job_id="nopool", pool=EnginePool(config.tiers))


def test_an_adapter_retrained_after_staging_is_refused_before_it_serves(make_config, demo_adapters, tmp_path):
    """From the red-team round: an adapter retrained between the DAG's stage and drain tasks was served under
    the item keys made with the staged digest, so outputs of the new weights were stored as the old one's."""
    import shutil

    from pipeline import JobError
    from pipeline.job import orchestrate

    adapter = tmp_path / "acme-adapter"
    shutil.copytree(demo_adapters["acme"], adapter)
    (tmp_path / "input").mkdir()
    (tmp_path / "input" / "a.jsonl").write_text(
        json.dumps({"id": "a", "tenant": "acme", "text": "The ferry runs."}) + "\n"
    )
    config = make_config(tenants__acme__adapter=str(adapter))
    migrate(config.state.url)  # the DAG's first task's part: this test starts at `plan`
    partitions = orchestrate.planned_partitions(config, "retrained")
    settings = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**settings, "revision": "retrained"}))  # in place
    with pytest.raises(JobError, match="retrained or moved since"):
        orchestrate.prepared_partition(config, "retrained", partitions[0])
    with pytest.raises(JobError, match="retrained or moved since"):
        orchestrate.drained_tier(config, "retrained", "small")
    with pytest.raises(JobError, match="retrained or moved since"):
        run_job(config, job_id="retrained")
