"""The fake engine reads prompts and writes answers as the tier's tokenizer does (tests/engine holds it to vLLM)."""

from __future__ import annotations

import re

from pipeline.config import SamplingConfig
from pipeline.generate.engine_api import load_tokenizer, plain_backend
from pipeline.generate.fake_engine import FILLER, FakeEngine

TEXTS = [
    "Quarterly revenue grew in every region; the board approved a larger budget for logistics.",
    "Naïve café owners in Zürich reported déjà vu — 東京 offices opened, ✓ twice.\tTabs\nand  spaces.",
    "<|bos|>Special tokens inside a document stay text: <|end|> audit</s><|im_end|>",
]


def test_answers_decode_and_draw_words_as_the_tokenizer_wrapper_does(make_config):
    tier = make_config(engine="fake").tiers["small"]
    engine, tokenizer = FakeEngine(tier), load_tokenizer(tier.model)
    assert plain_backend(tokenizer) is not None  # the fast path is the one under test
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    answers = engine.generate(prompts, [40] * len(prompts), SamplingConfig(temperature=0.0))
    for prompt, answer in zip(prompts, answers):
        assert answer.text == tokenizer.decode(list(answer.token_ids), skip_special_tokens=True)
        assert (
            list(answer.token_ids) == tokenizer.encode(answer.text, add_special_tokens=False)[: len(answer.token_ids)]
        )
        # Its words are the prompt's own (4 letters or more, as the wrapper decodes it) and filler words, as the
        # last one perhaps cut at its token limit.
        drawn = set(re.findall(r"[^\W\d_]{4,}", tokenizer.decode(prompt).lower())) | set(FILLER)
        assert set(answer.text.split()[:-1]) <= drawn


def test_the_rust_tokenizer_is_called_directly_only_where_it_gives_the_wrappers_ids(make_config):
    """Padding, truncation, special tokens split into pieces, or a wrapper that encodes or decodes in its own way:
    the wrapper is used (the same prompt would otherwise get other ids than the ones checked and priced)."""
    model = make_config(engine="fake").tiers["small"].model
    assert plain_backend(load_tokenizer(model)) is not None

    split = load_tokenizer(model)
    split.split_special_tokens = True
    padded = load_tokenizer(model)
    padded.backend_tokenizer.enable_padding()
    truncated = load_tokenizer(model)
    truncated.backend_tokenizer.enable_truncation(8)
    own = load_tokenizer(model)
    own.__class__ = type("OwnDecode", (type(own),), {"_decode": lambda self, ids, **kw: "x"})
    for tokenizer in (split, padded, truncated, own):
        assert plain_backend(tokenizer) is None
