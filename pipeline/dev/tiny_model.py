"""Build a tiny random-weight Llama model, fully offline, to exercise the real vLLM engine on CPUs.

Its outputs are gibberish: the weights are random. It exists so that tests, CI and the demo run
the same engine code path as production (tokenizer, chat template, continuous batching, prefix
cache, token accounting) without downloading anything. Real deployments point a tier's `model`
at a real checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.dev.samples import tokenizer_training_text

# Two clearly different sizes, so routing between tiers is visible in engine seconds.
SIZES = {
    "small": dict(
        hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2
    ),
    "large": dict(
        hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2
    ),
}
VOCAB_SIZE = 2048
MAX_POSITIONS = 2048
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def build_tokenizer(path: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tokenizer_training_text(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|end|>",
        pad_token="<|pad|>",
        model_max_length=MAX_POSITIONS,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def build_tiny_model(path: Path, size: str = "small", seed: int = 0) -> Path:
    """Write a loadable Hugging Face checkpoint (config, safetensors, tokenizer) to `path`."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(SIZES)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(path)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
        **SIZES[size],
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    model.save_pretrained(path, safe_serialization=True)
    (path / "TINY_MODEL.json").write_text(
        json.dumps(
            {
                "size": size,
                "seed": seed,
                "parameters": sum(p.numel() for p in model.parameters()),
                "note": "random weights: outputs are gibberish; built to exercise the real engine on CPUs",
            },
            indent=2,
        )
    )
    return path
