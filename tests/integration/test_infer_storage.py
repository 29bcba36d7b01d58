import pyarrow.fs as pafs
import pytest

from pipeline.config import TierConfig, TokenmillConfig
from pipeline.generate.engine import EnginePool
from pipeline.generate.engine_api import Completion, EngineDeadError, EngineStartError, load_tokenizer
from pipeline.generate.memory_units import generate
from pipeline.stores import storage
from tests.engines import OneCallEngine


class PoisonEngine(OneCallEngine):
    """Fails any batch holding the poison prompt, like an engine error on one bad item would."""

    calls: list[int] = []

    def __init__(self, tier):
        pass

    def generate(self, prompts, max_tokens, sampling):
        PoisonEngine.calls.append(len(prompts))
        if [666] in prompts:
            raise RuntimeError("kernel failure")
        return [Completion("ok", len(p), 0, m, "length") for p, m in zip(prompts, max_tokens)]


class DeadEngine(PoisonEngine):
    def generate(self, prompts, max_tokens, sampling):
        raise EngineDeadError("gone")


def rows(prompts):
    return [
        {
            "prompt_token_ids": p,
            "max_tokens": 4,
            "generation": {"item_key": f"r{i}", "id": f"r{i}", "tenant": "t", "scope": "s", "text": "doc"},
        }
        for i, p in enumerate(prompts)
    ]


def config(model, **sections):
    tiers = {"t": TierConfig(model=model, price_per_gpu_hour=1)}
    return TokenmillConfig(tiers=tiers, route={"default_tier": "t"}, **sections)


def test_failed_batch_is_halved_until_the_bad_item_is_alone():
    """Through the tier worker with no job (evals' path): the bad request fails alone, the others finish."""
    c = config("m-poison")
    pool = EnginePool(c.tiers, factory=PoisonEngine)
    PoisonEngine.calls.clear()
    done, report = generate(rows([[1], [2], [666], [4], [5], [6], [7], [8]]), "t", c, pool)
    assert sorted(done.items) == ["r0", "r1", "r3", "r4", "r5", "r6", "r7"]
    assert list(done.failed) == ["r2"] and "kernel failure" in done.failed["r2"].detail
    assert report.requests == 8 and all(i["gpu_seconds"] >= 0 for i in done.items.values())
    assert PoisonEngine.calls[0] == 8 and 1 in PoisonEngine.calls


def test_a_run_with_no_job_keeps_the_batch_full_under_a_budget_cap():
    """Reproducer: an eval on a config with budget caps ran one unit (256 requests) at a time, the
    engine's batch emptying at every unit's end; a run with no job admits nothing, so it fills the batch."""
    c = config("m-poison", budget={"max_job_usd": 5.0})
    PoisonEngine.calls.clear()
    done, _ = generate(rows([[i] for i in range(1, 301)]), "t", c, EnginePool(c.tiers, factory=PoisonEngine))
    assert len(done.items) == 300 and PoisonEngine.calls[0] == 300  # both units in the first step


def test_dead_engine_stops_the_job():
    c = config("m-dead")
    pool = EnginePool(c.tiers, factory=DeadEngine)
    with pytest.raises(EngineDeadError):
        generate(rows([[1], [2]]), "t", c, pool)


def test_missing_model_path_is_named(tmp_path):
    pool = EnginePool({"t": TierConfig(model=str(tmp_path / "absent"), price_per_gpu_hour=1)})
    with pytest.raises(EngineStartError, match=r"tier t: model path .*absent does not exist"):
        pool.engine("t")


def test_plain_tokenizer_loads_without_auto_classes_and_matches_them(tiny_models):
    from transformers import AutoTokenizer

    model = str(tiny_models / "tiny-small")
    ours, auto = load_tokenizer(model), AutoTokenizer.from_pretrained(model)
    messages = [{"role": "system", "content": "Summarise."}, {"role": "user", "content": "Revenue rose 5% in Oslo."}]
    rendered = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert (
        ours([rendered], add_special_tokens=False)["input_ids"]
        == auto([rendered], add_special_tokens=False)["input_ids"]
    )


def test_atomic_write_leaves_no_partial_file(tmp_path):
    class CrashBeforeRename:
        """The local filesystem, dying between writing the temporary file and renaming it."""

        def __init__(self):
            self.local = pafs.LocalFileSystem()

        def __getattr__(self, name):
            return getattr(self.local, name)

        def move(self, src, dst):
            raise OSError("disk full")

    root = storage.Location(CrashBeforeRename(), str(tmp_path))
    target = root.join("outputs", "x.parquet")
    with pytest.raises(storage.StorageError, match=r"outputs/x.parquet: disk full"):
        storage.write_bytes_atomic(root, target, b"data")
    assert list((tmp_path / "outputs").iterdir()) == []


def test_atomic_write_replaces_existing(tmp_path):
    root = storage.resolve(f"file://{tmp_path}")
    path = root.join("a", "b.bin")
    storage.write_bytes_atomic(root, path, b"one")
    storage.write_bytes_atomic(root, path, b"two")
    assert storage.read_bytes(root, path) == b"two" and [p.name for p in (tmp_path / "a").iterdir()] == ["b.bin"]
