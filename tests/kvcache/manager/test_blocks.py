"""Slot allocators and block tables (no torch)."""

from __future__ import annotations

import pytest

from flashmemory.kvcache.manager.blocks import BlockManager, Level, SlotAllocator


def test_the_most_recently_freed_slot_is_reused_first():
    alloc = SlotAllocator(8)
    a, b, c = alloc.allocate(), alloc.allocate(), alloc.allocate()
    assert (a, b, c) == (0, 1, 2)  # a fresh pool fills from slot 0
    alloc.free(b)
    alloc.free(a)
    assert alloc.allocate() == a and alloc.allocate() == b and alloc.allocate() == 3


def test_a_quiet_workload_keeps_touching_the_same_slots():
    alloc = SlotAllocator(1000)
    touched = set()
    for _ in range(200):  # one request after another, each taking and giving back 5 slots
        slots = [alloc.allocate() for _ in range(5)]
        touched.update(slots)
        for s in slots:
            alloc.free(s)
    assert touched == set(range(5))


def test_freeing_a_slot_twice_is_a_bookkeeping_error():
    alloc = SlotAllocator(2)
    s = alloc.allocate()
    alloc.free(s)
    with pytest.raises(ValueError):
        alloc.free(s)


def test_a_full_level_gives_none_and_freeing_a_sequence_returns_every_copy():
    blocks = BlockManager({Level.DEVICE: 1, Level.HOST: 2})
    blocks.add_sequence(7)
    i = blocks.append_block(7)
    blocks.attach(7, i, Level.DEVICE, blocks.allocate(Level.DEVICE))
    blocks.attach(7, i, Level.HOST, blocks.allocate(Level.HOST))
    assert blocks.allocate(Level.DEVICE) is None and blocks.allocate(Level.DISK) is None
    assert sorted(blocks.free_sequence(7)) == [(Level.DEVICE, 0), (Level.HOST, 0)]
    assert all(a.num_used == 0 for a in blocks.allocators.values())
