"""Demoting a whole sequence out of L0 and promoting it back (the server's preemption) loses nothing."""

from __future__ import annotations

import pytest
import torch

from flashmemory import FlashMemoryEngine
from flashmemory.kvcache.manager.blocks import Level

LEVELS = dict(block_size=8, active_window=16, warm_tokens=16, prefill_chunk_tokens=24, cpu_memory_gb=0.01,
              cold_zone_gb=0.01, max_num_seqs=3)  # L0 room for 3 windows: 2 sequences never compete


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return FlashMemoryEngine(model_path=str(tiny_llama), **LEVELS)


def _decode(engine, seq_id: int, tokens: list[int]) -> torch.Tensor:
    return torch.cat([engine._forward(seq_id, [t]) for t in tokens])


def test_demoted_then_promoted_sequence_decodes_exactly_as_before(engine):
    engine.clear_cache()
    ids = torch.randint(3, 300, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    cache = engine.cache
    reference, resumed = 1, 2
    for seq in (reference, resumed):
        cache.add_sequence(seq)
        engine._forward(seq, ids[:60])
    table = cache.blocks.tables[resumed]
    before = {i: {n: t.clone() for n, t in cache.device_pool.get_block(b.slots[Level.DEVICE]).items()}
              for i, b in enumerate(table.blocks) if Level.DEVICE in b.slots}
    used = cache.blocks.allocators[Level.DEVICE].num_used

    assert cache.demote_sequence(resumed) == len(before)
    assert cache.blocks.allocators[Level.DEVICE].num_used == used - len(before)  # its L0 slots are free
    assert all(Level.DEVICE not in b.slots and b.slots for b in table.blocks)  # every block still has a copy
    assert cache.promote_sequence(resumed) == len(before)
    after = {i: cache.device_pool.get_block(b.slots[Level.DEVICE])
             for i, b in enumerate(table.blocks) if Level.DEVICE in b.slots}
    assert after.keys() == before.keys()  # sink + window, as placement keeps them
    assert all(torch.equal(after[i][n], before[i][n]) for i in before for n in before[i])  # re-quantized identically
    # Decoding on from here gives the logits of the sequence that was never demoted.
    assert torch.equal(_decode(engine, resumed, ids[60:]), _decode(engine, reference, ids[60:]))
    assert engine.stats()["bytes_moved_L1->L0"] > 0
    engine.clear_cache()


def test_demoting_a_sequence_leaves_other_sequences_alone(engine):
    engine.clear_cache()
    cache = engine.cache
    for seq in (1, 2):
        cache.add_sequence(seq)
        engine._forward(seq, list(range(3, 43)))
    other = [b.slots.copy() for b in cache.blocks.tables[1].blocks]
    cache.demote_sequence(2)
    assert [b.slots for b in cache.blocks.tables[1].blocks] == other
    engine.clear_cache()
    assert cache.blocks.allocators[Level.DEVICE].num_used == 0
