"""KVBudget: its model of the placement policy matches what the tiered cache really holds on each level."""

from __future__ import annotations

import pytest

from flashmemory import FlashMemoryEngine
from flashmemory.kvcache.manager.blocks import Level
from flashmemory.kvcache.manager.capacity import KVBudget
from flashmemory.serve.worker import kv_budget

LEVELS = dict(block_size=8, active_window=16, warm_tokens=24, prefill_chunk_tokens=24, cpu_memory_gb=0.01,
              cold_zone_gb=0.01, max_num_seqs=2)


@pytest.mark.parametrize("cold_zone", [True, False])
def test_footprint_matches_the_tiered_cache_at_every_length(tiny_llama, cold_zone):
    engine = FlashMemoryEngine(model_path=str(tiny_llama), **{**LEVELS, "cold_zone_enabled": cold_zone})
    budget = kv_budget(engine)
    assert budget.cold_zone_enabled == cold_zone
    cache = engine.cache
    cache.add_sequence(0)
    engine._forward(0, list(range(3, 30)))  # a prefill chunk, then one token at a time
    seen = set()
    for step in range(90):
        n = cache.num_tokens(0)
        fp = budget.footprint(n)
        held = {level: a.num_used for level, a in cache.blocks.allocators.items()}
        assert (held[Level.DEVICE], held[Level.HOST], held.get(Level.DISK, 0)) == (
            fp.device_blocks, fp.host_blocks, fp.disk_blocks), f"at {n} tokens"
        seen.add((fp.device_blocks, fp.host_blocks, fp.disk_blocks))
        engine._forward(0, [5 + step % 7])
    assert len(seen) > 5  # the lengths crossed the window, the warm span and (with a cold zone) into L2
    engine.close()


def test_budget_of_the_contiguous_cache_counts_only_sequences(tiny_llama):
    engine = FlashMemoryEngine(model_path=str(tiny_llama), kv_cache="contiguous", max_num_seqs=3)
    budget = kv_budget(engine)
    assert budget.capacity_blocks == {} and budget.max_num_seqs == 3
    assert budget.usage([1000, 2000]) == {} and budget.unfit_reason(10**6) is None


def test_a_sequence_larger_than_a_level_is_unfit_and_says_which_setting_to_raise():
    budget = KVBudget(block_size=16, active_window_tokens=64, warm_tokens=64, num_sink_blocks=1,
                      capacity_blocks={Level.DEVICE: 10, Level.HOST: 8}, max_num_seqs=4)
    assert budget.unfit_reason(16 * 8) is None
    reason = budget.unfit_reason(16 * 9)
    assert reason is not None and "L1" in reason and "cpu_memory_gb" in reason
