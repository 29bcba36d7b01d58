"""What each request is: the prompt, sampling, how requests are built and ordered, and how engine time is weighed."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from pipeline.config.base import Section


class PromptConfig(Section):
    template_version: str = Field(
        "summarize-v1", description="Recorded in every output row; change it whenever `system` or `user` changes."
    )
    system: str = Field(
        "You are a careful analyst. Summarize documents faithfully and briefly.", description="System instruction."
    )
    user: str = Field(
        "Summarize the following document in a few sentences.\n\n{text}",
        description="User message; `{text}` is replaced by the document.",
    )

    @model_validator(mode="after")
    def _has_placeholder(self) -> "PromptConfig":
        if "{text}" not in self.user:
            raise ValueError("prompt.user must contain the placeholder {text}")
        return self


# The sampling knobs against loops and their neutral values (left out of item keys while neutral).
LOOP_KNOBS = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "min_tokens": 0, "stop": []}


class SamplingConfig(Section):
    max_tokens: int = Field(
        128, gt=0, description="Most output tokens per summary (capped by what the context leaves)."
    )
    temperature: float = Field(0.0, ge=0.0, description="0 is greedy: the reproducible choice for nightly batch work.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    seed: int | None = Field(0, description="Per-request sampling seed (used when temperature > 0).")
    json_schema: dict[str, Any] | None = Field(
        None,
        description=(
            "JSON schema every summary must follow, enforced by vLLM's guided decoding (compact "
            "JSON, no free whitespace). An output that still fails validation (cut off by max_tokens) "
            "is retried once with twice the token budget, then quarantined as `invalid_output`. "
            "Part of the item key: changing it regenerates."
        ),
    )
    # Against loops (vLLM's own names and meanings). Each is part of the item key only when it is set away from
    # its neutral value, so that keys made before these knobs existed stay valid.
    repetition_penalty: float = Field(
        1.0,
        gt=0.0,
        description=(
            "Above 1 makes tokens already in the prompt or output less likely (vLLM's `repetition_penalty`); "
            "1: off. It penalises the document's own words too: on the demo's corpus 1.2 ended "
            "SmolLM2-135M's loops but sent 76% of its summaries off topic (`frequency_penalty` "
            "did not). Part of the item key when not 1."
        ),
    )
    frequency_penalty: float = Field(
        0.0,
        ge=-2.0,
        le=2.0,
        description=(
            "Penalises a token by how often it already appears in the output (vLLM's `frequency_penalty`); 0: off."
        ),
    )
    presence_penalty: float = Field(
        0.0,
        ge=-2.0,
        le=2.0,
        description="Penalises a token that already appears in the output (vLLM's `presence_penalty`); 0: off.",
    )
    min_tokens: int = Field(
        0,
        ge=0,
        description="Output tokens generated before an end of sequence may stop it (vLLM's `min_tokens`); 0: off.",
    )
    stop: list[str] = Field(
        default_factory=list,
        description=(
            "Strings that end the output where they appear, not included (vLLM's `stop`), e.g. "
            "a blank line after a one-paragraph summary."
        ),
    )

    @model_validator(mode="after")
    def _schema_is_valid(self) -> "SamplingConfig":
        if self.json_schema is not None:
            from jsonschema import Draft202012Validator
            from jsonschema.exceptions import SchemaError

            try:
                Draft202012Validator.check_schema(self.json_schema)
            except SchemaError as e:
                raise ValueError(f"json_schema is not a valid JSON schema: {e.message}") from None
        return self

    def keyed(self) -> dict[str, Any]:
        """The parameters that decide an output, as item keys take them: the loop knobs only when set."""
        return {k: v for k, v in self.model_dump(mode="json").items() if LOOP_KNOBS.get(k, object()) != v}


class RequestsConfig(Section):
    """Building engine requests: render, tokenise, fit the context, order."""

    @model_validator(mode="before")
    @classmethod
    def no_engine_calls(cls, data: Any) -> Any:
        """Engine calls were `tokenmill eval`'s own path until 0.2; evals now stream through the tier worker."""
        gone = sorted({"items_per_engine_call", "long_items_per_engine_call"} & set(data or {}))
        if gone:
            raise ValueError(
                f"requests.{gone[0]} was removed: evals stream requests through the tier worker as "
                "jobs do (2 x vllm.max_num_seqs in flight); delete the field"
            )
        return data

    prefix_ordering: bool = Field(
        True,
        description=(
            "Send requests sorted by their token ids, so prompts sharing a prefix (system prompt, "
            "template, few-shot examples) run back to back and hit vLLM's prefix cache. Off: "
            "input order (for comparison)."
        ),
    )
    long_prompt_tokens: int = Field(
        4096,
        gt=0,
        description=(
            "Prompts at least this long go to the engine after their unit's shorter ones, so "
            "a few long prompts do not crowd a batch's KV cache (vLLM's scheduler, `max_num_batched_tokens`, "
            "admits them)."
        ),
    )
    long_documents: Literal["chunk", "quarantine"] = Field(
        "chunk",
        description=(
            "A document whose prompt exceeds the tier's context: `chunk` summarises it map-reduce "
            "style (chunk summaries, then a summary of them); `quarantine` rejects it as `too_long`."
        ),
    )


class CostConfig(Section):
    prefill_token_weight: float = Field(
        1.0,
        ge=0,
        description="Weight of an uncached prompt token when sharing an engine call's seconds among its items.",
    )
    cached_token_weight: float = Field(0.0, ge=0, description="Weight of a prompt token served from the prefix cache.")
    decode_token_weight: float = Field(
        1.0, ge=0, description="Weight of an output token (decode is memory-bound: one step per token)."
    )
