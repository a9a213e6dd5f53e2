"""What each KV pool holds at one moment: blocks and bytes, and how its slots are laid out (fragmentation)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from flashmemory.kvcache.kv_stats import MediumCounters
from flashmemory.kvcache.manager.blocks import level_label


@dataclass(frozen=True)
class PoolLayout:
    """One level's slots at one moment.

    A hole is a free slot below the highest used one: with fixed-size slots any free slot takes any block, so a
    hole wastes no capacity, but memory (and, for the sparse L2 file, disk) the OS committed to it holds nothing.
    """

    level: str
    capacity_slots: int  # slots it may use (the L0 budget when a budget controller moved it)
    used_slots: int
    bytes_per_slot: int
    free_runs: int  # maximal runs of consecutive free slots within the capacity
    largest_free_run: int
    holes: int  # free slots below the highest used slot
    committed_bytes: int  # memory or disk the OS has committed to the pool so far

    @property
    def used_bytes(self) -> int:
        return self.used_slots * self.bytes_per_slot

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_slots * self.bytes_per_slot

    @property
    def hole_share(self) -> float:
        """Share of the capacity in holes."""
        return self.holes / self.capacity_slots if self.capacity_slots else 0.0

    @property
    def committed_unused_bytes(self) -> int:
        return max(0, self.committed_bytes - self.used_bytes)

    def to_dict(self) -> dict:
        return {**asdict(self), "used_bytes": self.used_bytes, "capacity_bytes": self.capacity_bytes,
                "hole_share": self.hole_share, "committed_unused_bytes": self.committed_unused_bytes}


def layout(level: str, capacity: int, used: set[int], bytes_per_slot: int, committed: int) -> PoolLayout:
    """The layout of a pool of `capacity` slots of which `used` hold blocks."""
    runs = largest = current = 0
    for slot in range(capacity):
        if slot in used:
            current = 0
            continue
        if current == 0:
            runs += 1
        current += 1
        largest = max(largest, current)
    top = max(used) if used else -1
    holes = sum(1 for slot in range(top) if slot not in used)
    return PoolLayout(level, capacity, len(used), bytes_per_slot, runs, largest, holes, committed)


def pool_layouts(cache) -> dict[int, PoolLayout]:
    """Every level of a tiered cache, from its block tables (what holds each slot)."""
    used: dict[int, set[int]] = {level: set() for level in cache.levels}
    for table in cache.blocks.tables.values():
        for block in table.blocks:
            for level, slot in block.slots.items():
                used[level].add(slot)
    out = {}
    for level, storage in cache.levels.items():
        committed = MediumCounters.of(storage.counters()).bytes_committed or 0
        capacity = cache.blocks.allocators[level].num_slots
        name = f"{level_label(level)} {cache.hierarchy[level].name}"
        out[level] = layout(name, capacity, used[level], storage.bytes_per_slot, committed)
    return out
