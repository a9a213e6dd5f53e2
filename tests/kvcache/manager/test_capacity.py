"""KVCapacity: what a sequence holds on each level (from the cache's own PlacementPolicy) and when it can never fit."""

from __future__ import annotations

from flashmemory.kvcache.manager.blocks import Level
from flashmemory.kvcache.manager.capacity import KVCapacity, SequenceLoad
from flashmemory.kvcache.manager.policy import PlacementPolicy


def test_budget_of_the_contiguous_cache_counts_only_sequences():
    budget = KVCapacity(None, {}, max_num_seqs=3)
    assert budget.capacity_blocks == {} and budget.max_num_seqs == 3
    assert budget.usage([SequenceLoad(1000), SequenceLoad(2000)]) == {} and budget.unfit_reason(10**6) is None


def test_a_sequence_larger_than_a_level_is_unfit_and_says_which_setting_to_raise():
    budget = KVCapacity(PlacementPolicy(block_size=16, active_window_tokens=64, warm_tokens=64, num_sink_blocks=1,
                                        cold_zone_enabled=False),
                        capacity_blocks={Level.DEVICE: 10, Level.HOST: 8}, max_num_seqs=4)
    assert budget.unfit_reason(16 * 8) is None
    reason = budget.unfit_reason(16 * 9)
    assert reason is not None and "L1" in reason and "cpu_memory_gb" in reason


def test_parked_sequences_hold_nothing_on_the_device():
    policy = PlacementPolicy(16, 64, 64, 1, cold_zone_enabled=True)
    budget = KVCapacity(policy, {Level.DEVICE: 100, Level.HOST: 100, Level.DISK: 100}, max_num_seqs=4)
    running, parked = SequenceLoad(16 * 20), SequenceLoad(16 * 20, on_device=False)
    assert budget.usage([running])[Level.DEVICE] == 5  # 4 window blocks + the sink
    assert budget.usage([parked])[Level.DEVICE] == 0
    assert budget.usage([parked])[Level.HOST] == budget.usage([running])[Level.HOST] == 9  # window + warm + sink


def test_overflow_names_the_first_level_over_capacity_with_the_reserve_counted():
    budget = KVCapacity(PlacementPolicy(16, 64, 64, 1, True), {Level.DEVICE: 5, Level.HOST: 9, Level.DISK: 1})
    usage = budget.usage([SequenceLoad(16 * 20)])  # device 5, host 9, disk 11
    assert budget.overflow(usage) == Level.DISK
    assert budget.overflow({Level.DEVICE: 5, Level.HOST: 9}) is None
    assert budget.overflow({Level.DEVICE: 5, Level.HOST: 9}, reserve={Level.HOST: 1}) == Level.HOST
    assert budget.watermark() == {Level.DEVICE: 1, Level.HOST: 1, Level.DISK: 1}
