import pyarrow as pa
import pyarrow.fs as pafs
import pytest

from pipeline.config import SamplingConfig, TierConfig
from pipeline.generate.engine import EnginePool, run_inference
from pipeline.generate.engine_api import Completion, EngineDeadError, EngineStartError, load_tokenizer
from pipeline.generate.requests import REQUESTS
from pipeline.stores import storage


class PoisonEngine:
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


def requests(prompts):
    n = len(prompts)
    return pa.table({"id": [f"r{i}" for i in range(n)], "tier": ["t"] * n, "prompt_token_ids": prompts,
                     "max_tokens": [4] * n, "call": [0] * n, "shareable_tokens": [0] * n}, schema=REQUESTS)


def test_failed_batch_is_halved_until_the_bad_item_is_alone():
    pool = EnginePool({"t": TierConfig(model="m-poison", price_per_gpu_hour=1)}, factory=PoisonEngine)
    PoisonEngine.calls.clear()
    completions, calls, errors, _ = run_inference(requests([[1], [2], [666], [4], [5], [6], [7], [8]]), pool, SamplingConfig())
    assert sorted(completions["id"].to_pylist()) == ["r0", "r1", "r3", "r4", "r5", "r6", "r7"]
    assert errors["id"].to_pylist() == ["r2"] and "kernel failure" in errors["detail"][0].as_py()
    assert calls["items"].to_pylist() == [7] and calls["failed_attempts"].to_pylist() == [4]
    assert PoisonEngine.calls[0] == 8 and 1 in PoisonEngine.calls


def test_dead_engine_stops_the_job():
    pool = EnginePool({"t": TierConfig(model="m-dead", price_per_gpu_hour=1)}, factory=DeadEngine)
    with pytest.raises(EngineDeadError):
        run_inference(requests([[1], [2]]), pool, SamplingConfig())


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
    assert ours([rendered], add_special_tokens=False)["input_ids"] == auto([rendered], add_special_tokens=False)["input_ids"]


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
