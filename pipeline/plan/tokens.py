"""Token counts for a what-if that has no model files: the named model's tokenizer when it is on this machine, else
the local tier's, else a character-based approximation with its measured error (docs/estimate.md).

`WhatIfPool` is an EnginePool for planning only: it starts no engine, and a tier whose model files are missing
gets the best tokenizer there is instead of stopping the estimate. What each tier was counted with is kept in
`sources`, and the approximation is reported once per job, not once per file.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from pipeline.generate.engine import EnginePool
from pipeline.generate.engine_api import load_tokenizer

log = logging.getLogger(__name__)

# Characters per token of the approximation, and its error, measured on 2026-12-05 on the project's corpora
# (the demo's 60 documents, seed 101, and 300 hold-out documents, seed 0: pipeline/dev/holdout.py) against
# SmolLM2's tokenizer: the total within +0.2%, a document's count within 13% on average (90% within 27%,
# worst -38% / +35%). Tokenizers with larger vocabularies (Llama 3's 128k) cut English into fewer tokens.
CHARS_PER_TOKEN = 3.7
APPROXIMATION = (
    f"{CHARS_PER_TOKEN} characters per token (measured against SmolLM2's tokenizer on 360 documents of the "
    "project's corpora: total +0.2%, a document within 13% on average, 90% within 27%)"
)
# Hub ids of the presets' tokenizers, looked up in the local Hugging Face cache only (nothing is downloaded).
HUB_IDS = {
    "Llama-3.1-8B": "meta-llama/Llama-3.1-8B-Instruct",
    "Llama-3.1-70B": "meta-llama/Llama-3.1-70B-Instruct",
    "Llama-2-13B": "meta-llama/Llama-2-13b-chat-hf",
    "Llama-2-70B": "meta-llama/Llama-2-70b-chat-hf",
    "SmolLM2-135M": "HuggingFaceTB/SmolLM2-135M-Instruct",
}


class ApproxTokenizer:
    """Counts tokens as characters / CHARS_PER_TOKEN; renders a chat as its messages' text, one per line."""

    model_max_length = 4096

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False, add_generation_prompt: bool = True):
        return "\n".join(f"{m['role']}: {m['content']}" for m in messages) + ("\nassistant:" * add_generation_prompt)

    def __call__(self, texts: list[str], add_special_tokens: bool = False) -> dict:
        # ids are placeholders: only their number is read on the estimate's path
        return {"input_ids": [[0] * math.ceil(len(t) / CHARS_PER_TOKEN) for t in texts]}


def named_tokenizer(model: str):
    """The tokenizer of a what-if's named model (a folder, or a preset's Hub id in the local cache), else None."""
    folder = Path(model).expanduser()
    folder = folder.parent if folder.name == "config.json" else folder
    candidates = [str(folder)] if (folder / "tokenizer_config.json").exists() else []
    hub = next((h for n, h in HUB_IDS.items() if n.lower() == model.rsplit("/", 1)[-1].lower()), None)
    for candidate in candidates + ([hub] if hub else []):
        try:
            if candidate == hub:
                from transformers import AutoTokenizer

                return AutoTokenizer.from_pretrained(hub, local_files_only=True)
            return load_tokenizer(candidate)
        except Exception:  # not on this machine (or unreadable): the next source
            continue
    return None


class WhatIfPool(EnginePool):
    """Planning's pool for a what-if: per tier, the named model's tokenizer (`named`: tier -> model), else the
    tier's own, else ApproxTokenizer. `sources`: tier -> what its tokens were counted with."""

    def __init__(self, tiers, named: dict[str, str]):
        super().__init__(tiers)
        self.named, self.sources = named, {}

    def tokenizer(self, name: str):
        if name in self._tokenizers:
            return self._tokenizers[name]
        found = named_tokenizer(self.named[name]) if name in self.named else None
        source = f"the tokenizer of {self.named.get(name)}"
        if found is None:
            try:
                found, source = super().tokenizer(name), f"the tier's own tokenizer ({self.tiers[name].model})"
            except Exception as e:  # no model files here: the approximation, said once for the job
                found, source = ApproxTokenizer(), f"approximated: {APPROXIMATION}"
                log.warning("%s; token counts %s", e, source)
        self._tokenizers[name], self.sources[name] = found, source
        return found

    def context_length(self, name: str) -> int:
        tier = self.tiers[name]
        if tier.vllm.max_model_len:
            return tier.vllm.max_model_len
        return int(getattr(self.tokenizer(name), "model_max_length", ApproxTokenizer.model_max_length))
