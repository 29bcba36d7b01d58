"""The engine pool: one engine per tier per process, each tier's tokenizer and context length.

An engine is created on first use and reused by every later job in the same process (vLLM takes seconds
to minutes to start); a tier with no requests never starts one. A tier's `engine` setting picks what builds
it (ENGINES: vllm_engine.py's vLLM engine, or fake_engine.py's deterministic one). Every engine is fed
through its streaming interface (`add`/`step`) by the tier worker (worker.py).
"""

from __future__ import annotations

import atexit
import json
import logging
import time
import weakref
from collections.abc import Callable
from pathlib import Path

from pipeline.config import TierConfig
from pipeline.generate.engine_api import EngineStartError, StreamingEngine, load_tokenizer
from pipeline.generate.fake_engine import FakeEngine
from pipeline.generate.vllm_engine import VllmEngine
from pipeline.keys import adapter_digest

log = logging.getLogger(__name__)


def _model_path_problem(model: str) -> str | None:
    looks_local = model.startswith(("/", "./", "../", "~"))
    if looks_local and not Path(model).expanduser().exists():
        return f"model path {model} does not exist (tiny models: `tokenmill models tiny`)"
    return None


_ENGINES: dict[str, StreamingEngine] = {}  # process-wide: one engine per distinct tier configuration
# Tier fields that price, name or describe a tier's work, not how its engine runs it.
NOT_THE_ENGINE = {"price_per_gpu_hour", "served_model_names", "default_tokens_per_gpu_second", "gpu_model"}
# engine -> seconds its start took (an engine session's start-up). Weak keys: an engine stopped and collected
# takes its entry along, so a later engine at the same address never inherits it.
STARTUP_SECONDS: weakref.WeakKeyDictionary[StreamingEngine, float] = weakref.WeakKeyDictionary()


def shutdown_engines() -> None:
    """Stop every engine this process started (runs at exit; safe to call earlier)."""
    while _ENGINES:
        _key, engine = _ENGINES.popitem()
        stop = getattr(engine, "shutdown", None)
        if stop:
            try:
                stop()
            except Exception as e:  # exiting anyway: report, don't mask the job's own result
                log.warning("engine shutdown failed: %s", e)


# A tier's `engine` setting -> what builds it.
ENGINES: dict[str, Callable[..., StreamingEngine]] = {"vllm": VllmEngine, "fake": FakeEngine}


class EnginePool:
    """Tokenizers, context lengths and engines of the configured tiers, each built on first use."""

    def __init__(
        self,
        tiers: dict[str, TierConfig],
        factory: Callable[..., StreamingEngine] | None = None,
        adapters: dict[str, list[str]] | None = None,
    ):
        """`factory(tier[, adapters])` builds every tier's engine; unset, each tier's `engine` decides
        (ENGINES). `adapters`: per tier, the LoRA adapter folders its engine serves (config.tier_adapters())."""
        self.tiers, self.factory, self.adapters = tiers, factory, adapters or {}
        self._tokenizers: dict[str, object] = {}

    def _check(self, name: str) -> TierConfig:
        tier = self.tiers[name]
        problem = _model_path_problem(tier.model)
        if problem:
            raise EngineStartError(f"tier {name}: {problem}")
        return tier

    def tokenizer(self, name: str):
        if name not in self._tokenizers:
            tier = self._check(name)
            try:
                self._tokenizers[name] = load_tokenizer(tier.model)
            except Exception as e:
                raise EngineStartError(f"tier {name}: cannot load the tokenizer of {tier.model}: {e}") from e
        return self._tokenizers[name]

    def context_length(self, name: str) -> int:
        tier = self._check(name)
        if tier.vllm.max_model_len:
            return tier.vllm.max_model_len
        config_file = Path(tier.model).expanduser() / "config.json"
        if config_file.exists():
            return int(json.loads(config_file.read_text()).get("max_position_embeddings", 4096))
        return int(getattr(self.tokenizer(name), "model_max_length", 4096))

    def _key(self, name: str) -> str:
        # Adapters by content: an adapter retrained in place gets an engine that loads the new weights. What only
        # prices or names a tier's work is left out: a tier repriced or served under another name keeps its engine.
        adapters = [(path, adapter_digest(path)) for path in self.adapters.get(name, [])]
        tier = self.tiers[name].model_dump(mode="json", exclude=NOT_THE_ENGINE)
        return json.dumps([self._factory_of(name).__qualname__, tier, adapters], sort_keys=True)

    def _factory_of(self, name: str) -> Callable[..., StreamingEngine]:
        return self.factory or ENGINES[self.tiers[name].engine]

    def reset_prefix_caches(self) -> None:
        """Empty the prefix cache of every engine started for this pool's tiers.

        Engines outlive jobs in a process, and so do their KV blocks: benchmarks that compare runs
        over the same corpus call this so that each run starts from a cold cache.
        """
        for name in self.tiers:
            reset = getattr(_ENGINES.get(self._key(name)), "reset_prefix_cache", None)
            if reset is not None:
                reset()

    def shutdown(self, name: str) -> None:
        """Stop the tier's engine in this process (a worker about to exit frees its memory first)."""
        self._check(name)
        engine = _ENGINES.pop(self._key(name), None)
        stop = getattr(engine, "shutdown", None)
        if stop is not None:
            stop()

    def running(self, name: str) -> StreamingEngine | None:
        """The tier's engine when this process has started it, else None (starts nothing)."""
        self._check(name)
        return _ENGINES.get(self._key(name))

    def engine(self, name: str) -> StreamingEngine:
        tier = self._check(name)
        key = self._key(name)
        if key not in _ENGINES:
            started = time.perf_counter()
            if not _ENGINES:
                # Registered after multiprocessing's own exit hook (which importing multiprocessing.util
                # registers), so it runs first (atexit is last-in, first-out): that hook joins the
                # engine's processes and would wait forever on an engine still running. Nothing
                # imported before this point may be relied on to have imported it already.
                import multiprocessing.util  # noqa: F401

                atexit.register(shutdown_engines)
            try:
                adapters = self.adapters.get(name)
                factory = self._factory_of(name)
                _ENGINES[key] = factory(tier, adapters) if adapters else factory(tier)
            except EngineStartError as e:
                raise EngineStartError(f"tier {name}: {e}") from None
            STARTUP_SECONDS[_ENGINES[key]] = time.perf_counter() - started
            log.info("tier %s: engine for %s ready in %.1f s", name, tier.model, time.perf_counter() - started)
        return _ENGINES[key]
