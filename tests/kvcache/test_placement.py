"""Demoting a whole sequence out of L0 and promoting it back (the server's preemption) loses nothing
(synthetic K/V on the tiny model's geometry)."""

from __future__ import annotations

import pytest
import torch

from flashmemory.kvcache.manager.blocks import Level
from flashmemory.kvcache.tiered import TieredKVCache
from tests.kvcache.synthetic import SyntheticSequence, tiny_config

# L0 room for 3 windows: 2 sequences never compete.
LEVELS = dict(block_size=8, active_window=16, warm_tokens=16, max_num_seqs=3)


@pytest.fixture
def cache(tmp_path):
    c = TieredKVCache(tiny_config(cold_zone_dir=str(tmp_path), **LEVELS))
    yield c
    c.close()


def _decode(seq: SyntheticSequence, cache, start: int, end: int) -> torch.Tensor:
    return torch.cat([seq.forward(cache, t, t + 1) for t in range(start, end)], dim=1)


def test_demoted_then_promoted_sequence_decodes_exactly_as_before(cache):
    reference, resumed = SyntheticSequence(1, 70, seed=1), SyntheticSequence(2, 70, seed=1)  # the same tokens
    for seq in (reference, resumed):
        cache.add_sequence(seq.seq_id)
        seq.forward(cache, 0, 60)
    table = cache.blocks.tables[resumed.seq_id]
    before = {i: {n: t.clone() for n, t in cache.device_pool.get_block(b.slots[Level.DEVICE]).items()}
              for i, b in enumerate(table.blocks) if Level.DEVICE in b.slots}
    used = cache.blocks.allocators[Level.DEVICE].num_used

    assert cache.demote_sequence(resumed.seq_id) == len(before)
    assert cache.blocks.allocators[Level.DEVICE].num_used == used - len(before)  # its L0 slots are free
    assert all(Level.DEVICE not in b.slots and b.slots for b in table.blocks)  # every block still has a copy
    assert cache.promote_sequence(resumed.seq_id) == len(before)
    after = {i: cache.device_pool.get_block(b.slots[Level.DEVICE])
             for i, b in enumerate(table.blocks) if Level.DEVICE in b.slots}
    assert after.keys() == before.keys()  # sink + window, as placement keeps them
    assert all(torch.equal(after[i][n], before[i][n]) for i in before for n in before[i])  # re-quantized identically
    # Decoding on from here gives the outputs of the sequence that was never demoted.
    assert torch.equal(_decode(resumed, cache, 60, 70), _decode(reference, cache, 60, 70))
    assert cache.stats()["bytes_moved_L1->L0"] > 0


def test_demoting_a_sequence_leaves_other_sequences_alone(cache):
    for seq_id in (1, 2):
        cache.add_sequence(seq_id)
        SyntheticSequence(seq_id, 40).forward(cache, 0, 40)
    other = [b.slots.copy() for b in cache.blocks.tables[1].blocks]
    cache.demote_sequence(2)
    assert [b.slots for b in cache.blocks.tables[1].blocks] == other
    cache.clear()
    assert cache.blocks.allocators[Level.DEVICE].num_used == 0
