"""Demo LoRA adapters (pipeline/dev/adapters.py): built offline with peft on the tiny model, no vLLM engine."""

from __future__ import annotations

import json

import pytest

from pipeline.dev.adapters import AdapterError, adapter_digest, adapter_rank, build_demo_adapter


@pytest.fixture(scope="module")
def base(tiny_models):
    return tiny_models / "tiny-small"


def test_adapter_folder_rank_and_label(base, tmp_path):
    out = build_demo_adapter(base, tmp_path / "acme", "acme", rank=4)

    assert out == tmp_path / "acme"
    assert {"adapter_config.json", "adapter_model.safetensors", "DEMO_ADAPTER.md"} <= {p.name for p in out.iterdir()}
    assert adapter_rank(out) == 4
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["lora_alpha"] == 8 and config["peft_type"] == "LORA"
    assert config["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]  # sorted: stable bytes
    label = (out / "DEMO_ADAPTER.md").read_text()
    assert "not trained" in label and str(base.resolve()) in label and "rank: 4" in label


def test_digest_is_content_addressed(base, tmp_path):
    first = build_demo_adapter(base, tmp_path / "a1", "acme")
    again = build_demo_adapter(base, tmp_path / "a2", "acme")
    other = build_demo_adapter(base, tmp_path / "b", "globex")
    seeded = build_demo_adapter(base, tmp_path / "s", "acme", seed=7)

    assert adapter_digest(first) == adapter_digest(again)
    assert (first / "adapter_model.safetensors").read_bytes() == (again / "adapter_model.safetensors").read_bytes()
    assert adapter_digest(other) != adapter_digest(first)
    assert adapter_digest(seeded) != adapter_digest(first)
    assert len(adapter_digest(first)) == 32  # xxh3_128 hex


def test_adapter_changes_the_logits(base, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = build_demo_adapter(base, tmp_path / "acme", "acme")
    tokenizer = AutoTokenizer.from_pretrained(base)
    ids = tokenizer("Summarise: the council voted to extend the bike lanes.", return_tensors="pt")["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    with torch.no_grad():
        plain = model(ids).logits
        adapted = PeftModel.from_pretrained(model, out).eval()
        with_lora = adapted(ids).logits
        with adapted.disable_adapter():
            disabled = adapted(ids).logits

    assert torch.equal(disabled, plain)  # the same base weights underneath
    assert not torch.allclose(with_lora, plain, atol=1e-4)


def test_errors_are_plain(tmp_path):
    with pytest.raises(AdapterError, match="no config.json"):
        build_demo_adapter(tmp_path / "missing", tmp_path / "out", "acme")
    with pytest.raises(AdapterError, match="cannot read the LoRA rank"):
        adapter_rank(tmp_path)
    with pytest.raises(AdapterError, match="cannot read the adapter"):
        adapter_digest(tmp_path)
