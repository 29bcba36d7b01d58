"""The options read from vLLM's source (pipeline/generate/vllm_options.py) are the ones vLLM itself holds."""

from typing import get_args


def test_options_read_from_source_equal_vllms_own():
    from vllm.config.cache import CacheDType
    from vllm.config.speculative import SpeculativeMethod
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from pipeline.generate.vllm_options import vllm_options

    def flat(alias) -> set:
        return {v for a in get_args(alias) for v in (flat(a) if get_args(a) else {a})}

    options = vllm_options()
    assert set(options.kv_cache_dtypes) == flat(CacheDType)
    assert set(options.speculative_methods) == flat(SpeculativeMethod)
    assert list(options.quantization_methods) == QUANTIZATION_METHODS
    assert list(options.cpu_kv_cache_dtypes) == CPUAttentionBackend.supported_kv_cache_dtypes
    assert list(options.cpu_head_sizes) == CPUAttentionBackend.get_supported_head_sizes()
