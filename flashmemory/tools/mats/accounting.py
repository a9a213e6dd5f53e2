"""Slot accounting: every slot an allocator hands out is held by exactly one live block, and nothing else.

A leaked slot (allocated, but in no block table) is memory or disk the cache can never use again; a slot in two
tables would let one sequence read another's keys. Both are counted, per level.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from flashmemory.kvcache.manager.blocks import Level, level_label
from flashmemory.kvcache.tiered import TieredKVCache


@dataclass
class Accounting:
    """The outcome of one accounting pass over a cache."""

    leaked_slots: int = 0  # allocated on some level but held by no block
    problems: list[str] = field(default_factory=list)


def check_accounting(cache: TieredKVCache) -> Accounting:
    """Compare each level's allocator with what the live block tables hold."""
    out = Accounting()
    held: dict[Level, Counter[int]] = {level: Counter() for level in cache.blocks.allocators}
    for seq_id, table in cache.blocks.tables.items():
        for index, block in enumerate(table.blocks):
            if not block.slots:
                out.problems.append(f"sequence {seq_id} block {index} has no copy on any level")
            if set(block.slots) == {Level.DEVICE}:
                out.problems.append(f"sequence {seq_id} block {index}: its L0 (quantized) copy is its only copy")
            for level, slot in block.slots.items():
                held[level][slot] += 1
    if set(cache.blocks.tables) != set(cache.seqs):
        out.problems.append(f"block tables {sorted(cache.blocks.tables)} != live sequences {sorted(cache.seqs)}")
    for level, allocator in cache.blocks.allocators.items():
        shared = [slot for slot, n in held[level].items() if n > 1]
        if shared:
            out.problems.append(f"{level_label(level)} slots {shared[:8]} are held by more than "
                                "one block")
        used, holding = allocator.num_used, len(held[level])
        if used != holding:
            out.leaked_slots += abs(used - holding)
            out.problems.append(f"{level_label(level)}: the allocator has {used} slots in use, "
                                f"the block tables hold {holding}")
    return out


def staged_bytes(cache: TieredKVCache) -> dict[str, int]:
    """Bytes the prefetch subsystem still holds (L2 segments staged in host memory, L1 records on the device)."""
    out = {}
    if cache.prefetcher is not None:
        out["prefetch_staged_bytes"] = int(cache.prefetcher.stats()["prefetch_staged_bytes"])
    if cache.device_staging is not None:
        out["device_staging_bytes"] = int(cache.device_staging.stats()["device_staging_bytes"])
    return out
