"""Turning a device-KV budget into engine settings: the engine's L0 arena never exceeds the budget."""

from __future__ import annotations

import pytest

from flashmemory.tools.bench.device_budget import knobs_for_kv_budget
from flashmemory.errors import ConfigError

MIB = 2**20
BASE = {"kv_precision": "mixed", "max_num_seqs": 1}


def test_the_engine_built_from_the_settings_holds_at_most_the_budget(tiny_llama):
    from flashmemory import FlashMemoryEngine
    from flashmemory.model.loader import open_checkpoint

    cfg = open_checkpoint(tiny_llama).config
    budgeted = knobs_for_kv_budget(cfg, "float32", 3 * MIB, BASE)
    engine = FlashMemoryEngine(model_path=str(tiny_llama), **budgeted.knobs)
    capacity = engine.stats()["L0_bytes_capacity"]
    assert capacity == budgeted.device_kv_bytes
    assert 2 * MIB < capacity <= 3 * MIB  # whole-MiB rounding of max_gpu_memory_mb costs less than 1 MiB
    engine.close()


def test_a_small_budget_shrinks_the_window_to_what_fits(smollm2_path):
    from flashmemory.model.loader import open_checkpoint

    cfg = open_checkpoint(smollm2_path).config  # metadata only: no weights are read
    small = knobs_for_kv_budget(cfg, "float32", cfg.kv_bytes_per_token(2) * 512 // 4, BASE)
    large = knobs_for_kv_budget(cfg, "float32", 45 * MIB, BASE)
    assert small.knobs["active_window"] < 512 and small.device_kv_bytes <= small.kv_budget_bytes
    assert large.knobs["active_window"] == 2048 and large.device_kv_bytes <= 45 * MIB
    assert large.knobs["max_gpu_memory_mb"] > small.knobs["max_gpu_memory_mb"]


def test_a_budget_that_cannot_hold_two_blocks_is_refused_with_the_fix(tiny_llama):
    from flashmemory.model.loader import open_checkpoint

    cfg = open_checkpoint(tiny_llama).config
    with pytest.raises(ConfigError, match="raise --budget-mb"):
        knobs_for_kv_budget(cfg, "float32", 6000, BASE)
