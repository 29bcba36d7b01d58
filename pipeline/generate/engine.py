"""Generate, the engine: run engine requests through each tier's vLLM engine.

One engine per tier per process, created on first use and reused by every later job in the same
process (vLLM takes seconds to minutes to start). A tier with no requests never starts an engine.
An engine call that raises is retried with the batch halved, down to single items; an item that
still fails is reported as `engine_error`, so one bad item never takes the job down. A dead engine
process does end the job: retrying against it would only fail every item.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import time
import weakref
from collections.abc import Callable
from pathlib import Path

from pipeline.config import SamplingConfig, TierConfig
from pipeline.generate.adapters import lora_kwargs, lora_requests
from pipeline.generate.engine_api import (
    Completion,
    Engine,
    EngineDeadError,
    EngineStartError,
    Progressed,
    StreamingEngine,
    load_tokenizer,
)
from pipeline.generate.fake_engine import FakeEngine
from pipeline.generate.levers import cpu_dtype
from pipeline.keys import adapter_digest

log = logging.getLogger(__name__)


class VllmEngine:
    """vLLM's offline `LLM`, fed token ids, greedy or seeded sampling, with prefix-cache accounting."""

    def __init__(self, tier: TierConfig, adapters: list[str] | None = None):
        kwargs = tier.vllm.engine_kwargs()
        self.loras = {}
        if adapters:
            kwargs.update(lora_kwargs(adapters))
        if tier.device == "cpu":
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(tier.cpu_kvcache_space_gib)
            kwargs.setdefault("dtype", cpu_dtype(tier))  # float32 unless set (INT8 weights on AMX: bfloat16)
            kwargs.setdefault("enforce_eager", True)  # torch.compile warm-up costs a minute, gains nothing here
        # JSON-schema outputs (sampling.json_schema) without free whitespace: compact JSON is fewer
        # tokens, and a weak model cannot pad its way to max_tokens with indentation. Engine-wide in vLLM.
        kwargs.setdefault("structured_outputs_config", {"backend": "guidance", "disable_any_whitespace": True})
        try:
            from vllm import LLM
        except ImportError as e:
            raise EngineStartError(f"vLLM is not installed ({e}); install the `cpu` or `gpu` extra") from None
        try:
            # disable_log_stats=False: per-request metrics (and cached-token counts) need stats on.
            self.llm = LLM(model=tier.model, disable_log_stats=False, **kwargs)
        except Exception as e:  # vLLM raises many types at start-up; the caller needs one
            raise EngineStartError(f"could not start vLLM for {tier.model}: {type(e).__name__}: {e}") from e
        if adapters:
            self.loras = lora_requests(adapters)

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def shutdown(self) -> None:
        # Stop the engine-core process now: left to interpreter exit, the parent joins it and hangs.
        self.llm.llm_engine.engine_core.shutdown()

    def generate(self, prompts: list[list[int]], max_tokens: list[int], sampling: SamplingConfig) -> list[Completion]:
        from vllm.inputs import TokensPrompt

        params = [_params(m, sampling) for m in max_tokens]
        with _engine_death():
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [_completion(o) for o in outputs]

    # The streaming interface tier workers use: vLLM's own engine loop (LLMEngine.add_request / step), so
    # requests join the running batch as others finish and the scheduler never runs dry while work remains.
    def add(
        self, request_id: str, prompt: list[int], max_tokens: int, sampling: SamplingConfig, adapter: str | None = None
    ) -> None:
        """Queue one request; `adapter`: one of the adapter folders this engine was started with."""
        from vllm.inputs import TokensPrompt

        engine = self.llm.llm_engine
        if adapter is not None and adapter not in self.loras:
            raise ValueError(f"adapter {adapter} is not served by this engine (it serves {sorted(self.loras)})")
        with _engine_death():
            internal = engine.add_request(
                request_id,
                TokensPrompt(prompt_token_ids=prompt),
                _params(max_tokens, sampling),
                lora_request=self.loras.get(adapter),
            )
        self._ids = getattr(self, "_ids", {})
        self._ids[internal if isinstance(internal, str) else request_id] = request_id

    def step(self) -> list[Progressed]:
        """One engine step: (request id, output tokens so far, its Completion once finished) per request it advanced."""
        with _engine_death():
            outputs = self.llm.llm_engine.step()
        ids = getattr(self, "_ids", {})
        out = []
        for o in outputs:
            rid = ids.pop(o.request_id, o.request_id) if o.finished else ids.get(o.request_id, o.request_id)
            out.append(Progressed(rid, len(o.outputs[0].token_ids), _completion(o) if o.finished else None))
        return out

    def counters(self) -> dict:
        """Speculative and prefix-cache token counts since the engine started (levers.engine_counters)."""
        from pipeline.generate.levers import engine_counters

        return engine_counters(self.llm)

    def gauges(self) -> dict[str, float]:
        """vLLM's scheduler and KV-cache gauges as its last step set them (levers.engine_gauges)."""
        from pipeline.generate.levers import engine_gauges

        return engine_gauges(self.llm)


class _engine_death:
    """vLLM's EngineDeadError as ours: the job stops (retrying would fail every item)."""

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        try:
            from vllm.v1.engine.exceptions import EngineDeadError as VllmDead
        except ImportError:  # pragma: no cover - layout of other vLLM versions
            return False
        if kind is not None and issubclass(kind, VllmDead):
            raise EngineDeadError(f"the vLLM engine process died: {e}") from e
        return False


def _params(max_tokens: int, sampling: SamplingConfig):
    from vllm import SamplingParams

    structured = None
    if sampling.json_schema is not None:
        from vllm.sampling_params import StructuredOutputsParams

        structured = StructuredOutputsParams(
            json=sampling.json_schema
        )  # one per request: vLLM records its backend on it
    # logprobs=0: only the sampled token's log-probability, enough for the mean (escalation's signal).
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        seed=sampling.seed,
        logprobs=0,
        structured_outputs=structured,
        repetition_penalty=sampling.repetition_penalty,
        frequency_penalty=sampling.frequency_penalty,
        presence_penalty=sampling.presence_penalty,
        min_tokens=min(sampling.min_tokens, max_tokens),  # vLLM refuses more than max_tokens
        stop=sampling.stop or None,
    )


def _completion(o) -> Completion:
    return Completion(
        text=o.outputs[0].text,
        prompt_tokens=len(o.prompt_token_ids),
        cached_prompt_tokens=o.num_cached_tokens or 0,
        output_tokens=len(o.outputs[0].token_ids),
        finish_reason=o.outputs[0].finish_reason or "unknown",
        token_ids=tuple(o.outputs[0].token_ids),
        mean_logprob=_mean_logprob(o.outputs[0]),
    )


class BatchStepper:
    """The streaming interface over an engine that only has `generate` (test doubles that fail on purpose):
    each step runs everything added since the last one as one call."""

    def __init__(self, engine: Engine):
        self.engine, self.queued = engine, []

    def add(
        self, request_id: str, prompt: list[int], max_tokens: int, sampling: SamplingConfig, adapter: str | None = None
    ) -> None:
        if adapter is not None:
            raise ValueError(f"this engine serves no LoRA adapters (asked for {adapter})")
        self.queued.append((request_id, prompt, max_tokens, sampling))

    def step(self) -> list[Progressed]:
        queued, self.queued = self.queued, []
        if not queued:
            return []
        results = _generate_splitting(self.engine, [q[1] for q in queued], [q[2] for q in queued], queued[0][3], [0])
        return [
            Progressed(q[0], r.output_tokens, r) if isinstance(r, Completion) else Progressed(q[0], 0, None, r)
            for q, r in zip(queued, results)
        ]


def stepper(engine: Engine) -> StreamingEngine:
    """The engine's streaming interface: its own `add`/`step`, else one call per step."""
    return engine if hasattr(engine, "step") and hasattr(engine, "add") else BatchStepper(engine)


def _mean_logprob(output) -> float | None:
    n = len(output.token_ids)
    if not n or output.cumulative_logprob is None:
        return None
    return float(output.cumulative_logprob) / n


def _model_path_problem(model: str) -> str | None:
    looks_local = model.startswith(("/", "./", "../", "~"))
    if looks_local and not Path(model).expanduser().exists():
        return f"model path {model} does not exist (tiny models: `tokenmill models tiny`)"
    return None


_ENGINES: dict[str, Engine] = {}  # process-wide: one engine per distinct tier configuration
# Tier fields that price, name or describe a tier's work, not how its engine runs it.
NOT_THE_ENGINE = {"price_per_gpu_hour", "served_model_names", "default_tokens_per_gpu_second", "gpu_model"}
# engine -> seconds its start took (an engine session's start-up). Weak keys: an engine stopped and collected
# takes its entry along, so a later engine at the same address never inherits it.
STARTUP_SECONDS: weakref.WeakKeyDictionary[Engine, float] = weakref.WeakKeyDictionary()


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
ENGINES: dict[str, Callable[..., Engine]] = {"vllm": VllmEngine, "fake": FakeEngine}


class EnginePool:
    """Tokenizers, context lengths and engines of the configured tiers, each built on first use."""

    def __init__(
        self,
        tiers: dict[str, TierConfig],
        factory: Callable[..., Engine] | None = None,
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

    def _factory_of(self, name: str) -> Callable[..., Engine]:
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

    def running(self, name: str) -> Engine | None:
        """The tier's engine when this process has started it, else None (starts nothing)."""
        self._check(name)
        return _ENGINES.get(self._key(name))

    def engine(self, name: str) -> Engine:
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


def _generate_splitting(
    engine: Engine, prompts: list, max_tokens: list, sampling: SamplingConfig, attempts: list[int]
) -> list[Completion | str]:
    """Completions, or an error string per item that failed even alone. `attempts[0]` counts failures."""
    try:
        return list(engine.generate(prompts, max_tokens, sampling))
    except EngineDeadError:
        raise
    except Exception as e:  # any per-batch engine failure: split and retry
        attempts[0] += 1
        if len(prompts) == 1:
            return [f"{type(e).__name__}: {e}"[:500]]
        mid = len(prompts) // 2
        log.warning("engine call of %d items failed (%s); retrying as two halves", len(prompts), type(e).__name__)
        return _generate_splitting(engine, prompts[:mid], max_tokens[:mid], sampling, attempts) + _generate_splitting(
            engine, prompts[mid:], max_tokens[mid:], sampling, attempts
        )
