"""LimitedSlotAllocator: a limit on how many of a level's preallocated slots may be used (no torch)."""

from __future__ import annotations

import pytest

from flashmemory.kvcache.manager.slot_limit import LimitedSlotAllocator


def test_only_slots_below_the_limit_are_handed_out():
    alloc = LimitedSlotAllocator(8)
    alloc.set_limit(3)
    got = [alloc.allocate() for _ in range(4)]
    assert got == [0, 1, 2, None] and alloc.num_slots == alloc.limit == 3 and alloc.physical_slots == 8


def test_a_used_slot_above_a_new_limit_is_withheld_when_freed():
    alloc = LimitedSlotAllocator(6)
    slots = [alloc.allocate() for _ in range(6)]
    alloc.set_limit(4)
    assert alloc.used_above_limit() == [5, 4] and alloc.num_free == 0
    alloc.free(5)
    assert alloc.num_free == 0 and alloc.used_above_limit() == [4]
    alloc.free(1)
    assert alloc.allocate() == 1 and alloc.allocate() is None
    assert slots == list(range(6))


def test_raising_the_limit_gives_the_withheld_slots_back_low_ones_first():
    alloc = LimitedSlotAllocator(6)
    alloc.set_limit(2)
    assert alloc.num_free == 2
    alloc.set_limit(6)
    assert alloc.num_free == 6 and [alloc.allocate() for _ in range(6)] == list(range(6))


def test_a_limit_outside_the_pool_is_refused():
    alloc = LimitedSlotAllocator(4)
    for limit in (0, 5):
        with pytest.raises(ValueError):
            alloc.set_limit(limit)
