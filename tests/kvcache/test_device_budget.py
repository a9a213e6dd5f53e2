"""DeviceBudget: the L0 limit moved at run time. Shrinking relocates or demotes (never drops a sequence, never
loses a block), growing promotes back; attention over an exact (fp16, exact-selection) cache is unchanged."""

from __future__ import annotations

import torch

from flashmemory.kvcache.device_budget import DeviceBudget
from flashmemory.kvcache.manager.blocks import Level
from flashmemory.kvcache.tiered import TieredKVCache
from tests.kvcache.synthetic import HEADS, KV_HEADS, LAYERS, SyntheticSequence, tiny_config


def _cache(tmp_path) -> tuple[TieredKVCache, DeviceBudget]:
    cache = TieredKVCache(tiny_config(kv_precision="fp16", selection="exact", cold_zone_dir=str(tmp_path)))
    return cache, DeviceBudget(cache)


def _device_slots(cache: TieredKVCache) -> list[int]:
    return [b.slots[Level.DEVICE] for t in cache.blocks.tables.values() for b in t.blocks if Level.DEVICE in b.slots]


def _every_block_has_a_copy(cache: TieredKVCache) -> bool:
    return all(b.slots for t in cache.blocks.tables.values() for b in t.blocks)


def _decode_matches_reference(cache, seqs, steps) -> None:
    for seq, start in seqs:
        for t in range(start, start + steps):
            out = seq.forward(cache, t, t + 1)
            assert (out.double() - seq.reference(t, t + 1)).abs().max() <= 1e-4


def test_shrinking_moves_blocks_above_the_limit_into_free_slots_below(tmp_path):
    cache, budget = _cache(tmp_path)
    seqs = [SyntheticSequence(i, 90, seed=i) for i in range(3)]
    for seq in seqs:
        cache.add_sequence(seq.seq_id)
        seq.forward(cache, 0, 40)  # 5 blocks: the sink and the 2-block window in L0
    cache.free_sequence(0)  # the lowest slots come free; sequences 1 and 2 hold higher ones
    assert max(_device_slots(cache)) >= 6
    result = budget.resize(6)
    assert (result.limit_slots, result.demoted) == (6, 0) and result.relocated > 0
    assert max(_device_slots(cache)) < 6 and budget.allocator.used_above_limit() == []
    _decode_matches_reference(cache, [(seqs[1], 40), (seqs[2], 40)], 20)  # the copies moved intact
    assert max(_device_slots(cache)) < 6  # and nothing is placed above the limit afterwards
    cache.close()


def test_shrinking_below_what_is_used_demotes_the_oldest_copies_and_drops_no_sequence(tmp_path):
    cache, budget = _cache(tmp_path)
    seqs = [SyntheticSequence(i, 90, seed=i) for i in range(2)]
    for seq in seqs:
        cache.add_sequence(seq.seq_id)
        seq.forward(cache, 0, 40)
    assert budget.allocator.num_used == 6
    result = budget.resize(4)
    assert result.limit_slots == 4 and result.demoted == 2
    assert budget.allocator.num_used <= 4 and max(_device_slots(cache)) < 4
    assert cache.sequence_ids() == [0, 1] and _every_block_has_a_copy(cache)
    assert all(Level.DEVICE in cache.blocks.tables[s].blocks[0].slots for s in (0, 1))  # the sinks stay pinned
    _decode_matches_reference(cache, [(seqs[0], 40), (seqs[1], 40)], 12)  # demoted blocks are read from L1
    cache.close()


def test_growing_promotes_the_blocks_pressure_took_newest_first(tmp_path):
    cache, budget = _cache(tmp_path)
    seqs = [SyntheticSequence(i, 90, seed=i) for i in range(2)]
    for seq in seqs:
        cache.add_sequence(seq.seq_id)
        seq.forward(cache, 0, 40)
    budget.resize(4)
    result = budget.resize(budget.full_slots)
    assert result.limit_slots == 64 and result.promoted == 2
    fp = cache.kv_capacity().footprint(40)
    assert budget.allocator.num_used == 2 * fp.device_blocks  # the policy's footprint again
    _decode_matches_reference(cache, [(seqs[0], 40), (seqs[1], 40)], 12)
    cache.close()


def test_a_parked_sequence_is_left_to_the_scheduler(tmp_path):
    cache, budget = _cache(tmp_path)
    seq = SyntheticSequence(0, 50)
    cache.add_sequence(0)
    seq.forward(cache, 0, 40)
    cache.demote_sequence(0)  # preempted by the scheduler: no L0 copy at all
    budget.resize(10)
    assert budget.resize(64).promoted == 0 and _device_slots(cache) == []
    cache.close()


def test_the_limit_is_clamped_to_one_window_and_the_pool(tmp_path):
    cache, budget = _cache(tmp_path)
    assert budget.resize(1).limit_slots == budget.min_slots == 3  # 2 window blocks + the sink
    assert budget.resize(10_000).limit_slots == 64
    assert cache.kv_capacity().capacity_blocks[Level.DEVICE] == 64
    budget.resize(8)
    assert cache.kv_capacity().capacity_blocks[Level.DEVICE] == 8  # what the scheduler checks steps against
    cache.close()


def test_the_read_counter_counts_decode_reads_per_level(tmp_path):
    cache, budget = _cache(tmp_path)
    seq = SyntheticSequence(0, 60)
    cache.add_sequence(0)
    seq.forward(cache, 0, 50)  # 6 blocks: 3 in L0, 2 in L1, 1 in L2 (warm 16 tokens)
    assert budget.read_counts() == (0, 0)  # prefill is not counted
    seq.forward(cache, 50, 51)
    l0, total = budget.read_counts()
    # and the filling block (2 tokens and the new one) from its FP16 row in device memory
    assert (l0, total) == (4 * KV_HEADS * LAYERS, 7 * KV_HEADS * LAYERS)
    assert cache.attention.name in ("native", "torch") and HEADS == 4
    cache.close()


def test_reads_of_the_fp16_rows_count_as_l0_reads(tmp_path):
    # A row of 128 FP16 tokens covering the whole 128-token window: no decode step reads an INT4 L0 copy, yet
    # every one of the window's blocks is served from device memory.
    cache = TieredKVCache(tiny_config(kv_precision="mixed", active_window=128, warm_tokens=64, recent_fp16_tokens=128,
                                      cold_zone_dir=str(tmp_path)))
    budget = DeviceBudget(cache)
    seq = SyntheticSequence(0, 120)
    cache.add_sequence(0)
    seq.forward(cache, 0, 100)
    seq.forward(cache, 100, 101)
    l0, total = budget.read_counts()
    assert cache.attention.row_reads == l0 == total == 13 * KV_HEADS * LAYERS  # 12 full blocks, the filling one
    cache.close()


def _l0_records(cache) -> dict[tuple[int, int], dict]:
    """Every L0 copy's stored parts (cloned), by (seq_id, block index)."""
    return {(seq_id, i): {n: t.clone() for n, t in cache.levels[Level.DEVICE].read_block(b.slots[Level.DEVICE]).items()}
            for seq_id, t in cache.blocks.tables.items() for i, b in enumerate(t.blocks) if Level.DEVICE in b.slots}


def _same_records(before: dict, after: dict) -> bool:
    return all(all(torch.equal(parts[n], after[key][n]) for n in parts) for key, parts in before.items()
               if key in after)


def test_shrinking_gives_device_memory_back_and_growing_takes_it_again_with_the_blocks_intact(tmp_path):
    cache, budget = _cache(tmp_path)
    arena = cache.levels[Level.DEVICE]
    seqs = [SyntheticSequence(i, 90, seed=i) for i in range(2)]
    for seq in seqs:
        cache.add_sequence(seq.seq_id)
        seq.forward(cache, 0, 40)
    full = arena.storage.numel()  # counted from the tensor, not derived from the slot count
    assert budget.allocated_bytes == full == 64 * budget.slot_bytes == cache.stats()["L0_bytes_allocated"]
    kept = _l0_records(cache)
    result = budget.resize(8)
    assert arena.storage.numel() == result.allocated_bytes == 8 * budget.slot_bytes < full  # two 4-slot segments
    assert cache.stats()["L0_bytes_allocated"] == 8 * budget.slot_bytes
    assert _same_records(kept, _l0_records(cache)) and len(_l0_records(cache)) == 6  # every copy stayed, intact
    _decode_matches_reference(cache, [(seqs[0], 40), (seqs[1], 40)], 12)
    kept = _l0_records(cache)
    result = budget.resize(64)
    assert arena.storage.numel() == result.allocated_bytes == full and result.limit_slots == 64
    assert _same_records(kept, _l0_records(cache))
    _decode_matches_reference(cache, [(seqs[0], 52), (seqs[1], 52)], 12)
    cache.close()


def test_a_grow_the_device_cannot_serve_keeps_the_smaller_arena_and_limit(tmp_path, monkeypatch):
    cache, budget = _cache(tmp_path)
    arena = cache.levels[Level.DEVICE]
    seq = SyntheticSequence(0, 90)
    cache.add_sequence(0)
    seq.forward(cache, 0, 40)
    budget.resize(8)
    kept = _l0_records(cache)
    allocate = arena._allocate

    def out_of_memory(num_slots: int):
        if num_slots > 8:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated: another process took it)")
        return allocate(num_slots)

    monkeypatch.setattr(arena, "_allocate", out_of_memory)
    result = budget.resize(64)
    assert result.limit_slots == 8 == budget.limit_slots and result.allocated_bytes == 8 * budget.slot_bytes
    assert _same_records(kept, _l0_records(cache))
    _decode_matches_reference(cache, [(seq, 40)], 12)
    cache.close()
