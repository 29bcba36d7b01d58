"""Engine: the same tiny model and prompts through tokenmill's vLLM path, and Hugging Face `generate`
one prompt at a time and in static batches of 16. Output tokens per second of each, the ratios, and
whether greedy outputs of tokenmill's path and one-at-a-time `generate` are identical.

Usage: python benchmarks/engine.py [PROMPTS] (default 200 prompts of about 256 tokens, 32 new tokens)
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.common import emit
    from pipeline.config import SamplingConfig, load_config
    from pipeline.dev.samples import synthetic_document
    from pipeline.generate.engine import EnginePool, shutdown_engines
    from pipeline.generate.requests import render_messages

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    new_tokens = 32
    config = load_config(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
    pool = EnginePool(config.tiers)
    tok = pool.tokenizer("small")
    rng = random.Random(9)
    prompts = []
    while len(prompts) < n:
        text = tok.apply_chat_template(
            render_messages(synthetic_document(rng, 12), config.prompt), tokenize=False, add_generation_prompt=True
        )
        ids = tok(text, add_special_tokens=False)["input_ids"][:256]
        prompts.append(ids)
    sampling = SamplingConfig(max_tokens=new_tokens, temperature=0.0)

    engine = pool.engine("small")
    engine.generate(prompts[:4], [new_tokens] * 4, sampling)  # warm-up
    started = time.perf_counter()
    vllm_out = engine.generate(prompts, [new_tokens] * n, sampling)
    vllm_s = time.perf_counter() - started
    vllm_tokens = sum(c.output_tokens for c in vllm_out)
    shutdown_engines()

    torch.set_num_threads(1)  # one prompt at a time: the loop people write first
    model = AutoModelForCausalLM.from_pretrained(config.tiers["small"].model, torch_dtype=torch.float32).eval()
    eos = None  # random weights: never stop early, like vLLM with the same max_tokens

    def hf_generate(batch):
        width = max(len(p) for p in batch)
        ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=tok.pad_token_id,
            )
        return [row[width:].tolist() for row in out]

    started = time.perf_counter()
    single = [hf_generate([p])[0] for p in prompts]
    single_s = time.perf_counter() - started
    torch.set_num_threads(max(1, __import__("os").cpu_count()))
    started = time.perf_counter()
    batched = [row for i in range(0, n, 16) for row in hf_generate(prompts[i : i + 16])]
    batched_s = time.perf_counter() - started
    hf_tokens = sum(len(s) for s in single)

    same = sum(list(c.token_ids) == s for c, s in zip(vllm_out, single))
    emit(
        "engine",
        {
            "model": "tiny random-weight Llama (small), fp32, CPU",
            "prompts": n,
            "prompt_tokens_each": "<= 256",
            "new_tokens": new_tokens,
            "tokenmill_vllm_tok_s": round(vllm_tokens / vllm_s),
            "hf_one_at_a_time_tok_s": round(hf_tokens / single_s),
            "hf_static_batch16_tok_s": round(sum(len(s) for s in batched) / batched_s),
            "vllm_vs_one_at_a_time": round((vllm_tokens / vllm_s) / (hf_tokens / single_s), 1),
            "vllm_vs_batch16": round((vllm_tokens / vllm_s) / (sum(len(s) for s in batched) / batched_s), 1),
            "greedy_outputs_identical": f"{same}/{n} (token ids, tokenmill's vLLM path vs HF one at a time)",
        },
    )
