"""LimitedSlotAllocator: a level's slot allocator with a run-time limit on how many of its slots may be used (the
L0 budget the DynamicBudgetController moves), without torch."""

from __future__ import annotations

from flashmemory.kvcache.manager.blocks import SlotAllocator


class LimitedSlotAllocator(SlotAllocator):
    """A SlotAllocator that hands out only slots below `limit`; the pool behind it stays preallocated at its full
    size (`physical_slots`), the limit says how much of it may hold blocks.

    `num_slots` is the limit (what the scheduler's capacity checks and the stats see). Free slots at or above the
    limit are withheld; a used one stays used until its block is moved (DeviceBudget.resize relocates or demotes
    it) and is withheld when freed.
    NOTE: relies on SlotAllocator keeping its free stack in `_free` and its used set in `_used`.
    """

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots)
        self.physical_slots = num_slots
        self._withheld: list[int] = []  # free slots at or above the limit

    @property
    def limit(self) -> int:
        return self.num_slots

    def used_slots(self) -> list[int]:
        """Every used slot, lowest first (the records a re-sized arena must keep)."""
        return sorted(self._used)

    def used_above_limit(self) -> list[int]:
        """Used slots at or above the limit (blocks a shrink still has to move), highest first."""
        return sorted((s for s in self._used if s >= self.num_slots), reverse=True)

    def set_limit(self, limit: int) -> None:
        """Use slots [0, limit) from now on (1 <= limit <= physical_slots)."""
        if not 1 <= limit <= self.physical_slots:
            raise ValueError(f"limit {limit} outside [1, {self.physical_slots}]")  # the budget clamps it first
        pool = self._free + self._withheld
        self.num_slots = limit
        # Low slots on top of the stack: the pool's beginning stays the working set (see SlotAllocator).
        self._free = sorted((s for s in pool if s < limit), reverse=True)
        self._withheld = [s for s in pool if s >= limit]

    def free(self, slot: int) -> None:
        super().free(slot)
        if slot >= self.num_slots:
            self._withheld.append(self._free.pop())  # the slot super() just pushed on top of the stack
