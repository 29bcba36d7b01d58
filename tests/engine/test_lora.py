"""LoRA adapters in the real vLLM engine: a batch mixing the base model and two tenants' adapters gives each
request exactly what it gets alone (vLLM 0.32's CPU LoRA ops did not, unless one slot is left free:
pipeline/generate/adapters.py lora_kwargs). Keys and tenant isolation are tested on the fake engine
(tests/integration/test_adapters.py)."""

from __future__ import annotations

from pipeline.generate.engine import EnginePool
from tests.engines import drain
from tests.integration.test_adapters import tenants


def run_to_end(engine, requests, sampling):
    """Every (request id, token ids, adapter) at once, 24 tokens each: their output token ids."""
    done = drain(engine, [(rid, ids, 24, adapter) for rid, ids, adapter in requests], sampling)[1]
    return {rid: c.token_ids for rid, c in done.items()}


def test_a_mixed_batch_gives_each_request_what_it_gets_alone(make_config, demo_adapters):
    """vLLM 0.32's CPU LoRA ops give base requests in a mixed batch the last slot's adapter unless one slot
    is left free (adapters.lora_kwargs). Each request of a batch mixing base and two adapters must get
    exactly the tokens it gets alone."""
    config = make_config(engine="vllm", **tenants(demo_adapters, "acme", "globex"))
    pool = EnginePool(config.tiers, adapters=config.tier_adapters())
    tok = pool.tokenizer("small")
    texts = [
        "The quarterly report shows revenue grew in the north region.",
        "Minutes of the board meeting on safety.",
        "A short note about the new office coffee machine.",
        "Release notes: fixed a crash when saving files.",
    ]
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    adapters = [None, demo_adapters["acme"], demo_adapters["globex"]]
    requests = [(f"{i}-{j}", ids[i], adapter) for i in range(len(texts)) for j, adapter in enumerate(adapters)]
    engine = pool.engine("small")
    from pipeline.generate.worker import batch_size

    assert batch_size(engine, None) == config.tiers["small"].vllm.max_num_seqs  # read from vLLM's scheduler, as set
    mixed = run_to_end(engine, requests, config.sampling)
    alone = {}
    for request in requests:
        alone.update(run_to_end(engine, [(request[0] + "-alone", request[1], request[2])], config.sampling))
    for rid, _, _ in requests:
        assert mixed[rid] == alone[rid + "-alone"], f"request {rid} got other tokens in the mixed batch"
    # The adapters do something: each changes the output of at least one text.
    for j in (1, 2):
        assert any(mixed[f"{i}-{j}"] != mixed[f"{i}-0"] for i in range(len(texts))), f"adapter {j} changed nothing"
