"""Start-up sizing with the 32K model's geometry (Qwen2.5-Coder-0.5B: 24 layers, 2 KV heads of 64): the device
budget message, L0 slots for the window, and the KV a 32K context needs on each level."""

from __future__ import annotations

import pytest

from flashmemory.config import EngineConfig
from flashmemory.engine.sizing import MIB, plan_device, tiered_config
from flashmemory.errors import MemoryBudgetError
from flashmemory.model.model_config import ModelConfig

QWEN = ModelConfig(architecture="Qwen2ForCausalLM", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                   num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6,
                   max_position_embeddings=32768, rope_theta=1e6, qkv_bias=True)
WEIGHTS = QWEN.num_parameters() * 4  # float32


def test_the_32k_model_needs_12_kib_of_fp16_kv_per_token():
    assert QWEN.kv_bytes_per_token(2) == 12 * 1024
    assert QWEN.kv_bytes_per_token(2) * 32768 == 384 * MIB


def test_a_budget_too_small_for_the_32k_model_says_what_fits_and_what_to_raise():
    cfg = EngineConfig(block_size="auto", max_gpu_memory_mb=2000)
    with pytest.raises(MemoryBudgetError) as e:
        plan_device(cfg, QWEN, WEIGHTS, __import__("torch").float32, cfg.resolve_block_size(32768))
    message = str(e.value)
    for part in ("max_gpu_memory_mb=2000 is too small", "the weights need", "The largest active_window that fits",
                 "Raise max_gpu_memory_mb to at least"):
        assert part in message


def test_the_default_window_of_the_32k_model_fits_in_a_few_mib_of_device_kv():
    import torch

    cfg = EngineConfig(block_size="auto", max_gpu_memory_mb=4096)
    block = cfg.resolve_block_size(32768)
    plan = plan_device(cfg, QWEN, WEIGHTS, torch.float32, block)
    tiered = tiered_config(cfg, QWEN, plan, block, torch.device("cpu"), "qwen")
    window_blocks = cfg.active_window // block + 1  # + the attention-sink block
    assert plan.device_slots >= window_blocks
    l0_window_bytes = window_blocks * plan.slot_bytes
    assert l0_window_bytes < 0.05 * 384 * MIB  # INT4 window + sink: under 5 % of the exact FP16 cache at 32K
    assert tiered.block_size == 32 and tiered.num_kv_heads == 2
