"""What every engine speaks, real or fake: the `Engine` protocol, what it returns (`Completion`,
`Progressed`), the errors the job acts on, and the tokenizer a tier's requests are built with.

Its own module so that the vLLM engine (engine.py) and the deterministic fake (fake_engine.py) share
one set of types, and the engine pool picks between them without an import circle.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pipeline.config import SamplingConfig


class EngineStartError(RuntimeError):
    """A tier's engine could not be started; the message names the tier and model."""


class EngineDeadError(RuntimeError):
    """The engine process died mid-job; the job stops (retrying would fail every item)."""


@dataclass(frozen=True)
class Completion:
    text: str
    prompt_tokens: int
    cached_prompt_tokens: int
    output_tokens: int
    finish_reason: str
    token_ids: tuple[int, ...] = ()  # the generated ids (benchmarks compare engines on them)
    mean_logprob: float | None = None  # mean log-probability of the generated tokens: the confidence signal


class Engine(Protocol):
    """An inference engine's one-call interface: `generate` (a whole batch, all or nothing), what
    benchmarks compare engines with. The tier worker feeds engines through StreamingEngine's `add`/`step`."""

    def generate(
        self, prompts: list[list[int]], max_tokens: list[int], sampling: SamplingConfig
    ) -> list[Completion]: ...


class StreamingEngine(Engine, Protocol):
    """vLLM's own loop: requests are added one at a time and join the running batch; each `step` advances
    every running request and says how far (`Progressed`), with the Completion of those that finished."""

    def add(
        self, request_id: str, prompt: list[int], max_tokens: int, sampling: SamplingConfig, adapter: str | None = None
    ) -> None: ...

    def step(self) -> list[Progressed]: ...


@dataclass(frozen=True)
class Progressed:
    request_id: str
    output_tokens: int
    completion: Completion | None  # set when the request finished in this step
    error: str | None = None  # set when it failed (even alone): no completion will come


# Tokenizer classes that are the plain Rust tokenizer from tokenizer.json, with nothing model-specific.
_PLAIN_TOKENIZERS = {None, "PreTrainedTokenizerFast", "TokenizersBackend"}


# What a wrapper may override to encode or decode otherwise than its Rust tokenizer does.
_CODEC_METHODS = ("encode", "_encode_plus", "decode", "_decode", "__call__")


def plain_backend(tokenizer):
    """The tokenizer's Rust tokenizer, to call directly (the wrapper's checks of every id cost more than the work,
    on every prompt), where that gives the wrapper's ids and text: a wrapper that overrides none of encoding and
    decoding, with no padding, truncation, splitting of special tokens (the wrapper sets that on the Rust
    tokenizer at each call) or clean-up of spaces. None otherwise: use the wrapper."""
    from transformers import PreTrainedTokenizerFast

    backend = getattr(tokenizer, "backend_tokenizer", None)
    kind = type(tokenizer)
    if (
        backend is None
        or not isinstance(tokenizer, PreTrainedTokenizerFast)
        or any(getattr(kind, m) is not getattr(PreTrainedTokenizerFast, m) for m in _CODEC_METHODS)
        or backend.padding is not None
        or backend.truncation is not None
        or getattr(tokenizer, "split_special_tokens", False)
        or getattr(backend, "encode_special_tokens", False)
        or getattr(tokenizer, "clean_up_tokenization_spaces", False)
    ):
        return None
    return backend


def load_tokenizer(model: str):
    """The tier's tokenizer (with its chat template). A plain tokenizer.json loads without
    `AutoTokenizer`, whose import pulls in torch and every model family (5 s, once per process,
    for a job that never runs a model); any other class goes through `AutoTokenizer`."""
    path = Path(model).expanduser()
    config_file = path / "tokenizer_config.json"
    if (
        (path / "tokenizer.json").exists()
        and config_file.exists()
        and json.loads(config_file.read_text()).get("tokenizer_class") in _PLAIN_TOKENIZERS
    ):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)
