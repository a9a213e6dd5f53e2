"""Counting the KV bytes an engine holds."""

from __future__ import annotations

import pytest
import torch

from flashmemory.tools.bench.kv_bytes import llama_cpp_kv_bytes, tensor_bytes_by_device
from tests.helpers import tiny_hf_config


def test_a_dynamic_cache_counts_its_keys_and_values():
    from transformers.cache_utils import DynamicCache

    config = tiny_hf_config("LlamaForCausalLM", 320)  # 2 layers, 2 KV heads, head_dim 16
    cache = DynamicCache(config=config)
    for layer in range(2):
        cache.update(torch.randn(1, 2, 100, 16), torch.randn(1, 2, 100, 16), layer)
    assert tensor_bytes_by_device(cache.layers) == {"cpu": 2 * 2 * 2 * 100 * 16 * 4}


def test_a_storage_reached_twice_is_counted_once():
    base = torch.zeros(1000, dtype=torch.float16)
    holder = {"a": base, "b": base[10:20], "c": [base.view(10, 100)], "d": torch.ones(3)}
    assert tensor_bytes_by_device(holder) == {"cpu": 2000 + 12}


def test_a_quantized_cache_counts_its_packed_codes_and_scales():
    pytest.importorskip("hqq")
    from transformers.cache_utils import QuantizedCache

    config = tiny_hf_config("LlamaForCausalLM", 320)
    cache = QuantizedCache("hqq", config, nbits=4, axis_key=1, axis_value=1)
    for layer in range(2):
        cache.update(torch.randn(1, 2, 256, 16), torch.randn(1, 2, 256, 16), layer)
    counted = tensor_bytes_by_device(cache.layers)["cpu"]
    fp32 = 2 * 2 * 2 * 256 * 16 * 4
    assert fp32 / 8 < counted < fp32 / 3  # 4-bit codes (1/8 of fp32) plus scales and zero points


def test_llama_cpp_layout_bytes():
    assert llama_cpp_kv_bytes("f16", "f16", 256, 30, 192) == 256 * 30 * 2 * 192 * 2
    assert llama_cpp_kv_bytes("q4_0", "q4_0", 512, 30, 192) == 512 * 30 * 2 * 6 * 18
    assert llama_cpp_kv_bytes("q8_0", "f16", 256, 1, 64) == 256 * (2 * 34 + 64 * 2)
    with pytest.raises(ValueError, match="not a multiple"):
        llama_cpp_kv_bytes("q4_0", "q4_0", 256, 1, 48)
