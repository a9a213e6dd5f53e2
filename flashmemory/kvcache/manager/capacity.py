"""KVBudget: how many blocks a sequence holds on each KV level, and whether a set of sequences fits (no torch).

The scheduler decides admission and preemption with this model of the tiered cache's placement policy
(kvcache/placement.py): a sequence of n tokens keeps its newest `active_window` tokens of full blocks plus
the attention-sink blocks in L0; every full block has an FP16 copy in L1 until it is `warm_tokens` older than
the window, then it lives in L2 (sink blocks stay in L1). Without a cold zone every full block stays in L1.
The still-filling block of each live sequence is a staging row, not a slot: rows are counted separately.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from flashmemory.kvcache.manager.blocks import Level

TIER_NAMES = {Level.DEVICE: "L0", Level.HOST: "L1", Level.DISK: "L2"}
_SETTING_TO_RAISE = {
    Level.DEVICE: "max_gpu_memory_mb (or lower active_window)",
    Level.HOST: "cpu_memory_gb",
    Level.DISK: "cold_zone_gb",
}


@dataclass(frozen=True)
class Footprint:
    """Blocks one sequence holds per level (a level absent from the cache counts 0)."""

    device_blocks: int
    host_blocks: int
    disk_blocks: int

    def on(self, level: Level) -> int:
        return (self.device_blocks, self.host_blocks, self.disk_blocks)[int(level)]


@dataclass(frozen=True)
class KVBudget:
    """Capacity of every level in blocks and the placement policy that fills them."""

    block_size: int  # tokens per block
    active_window_tokens: int  # newest tokens kept in L0
    warm_tokens: int  # tokens after the window kept in L1 when a cold zone exists
    num_sink_blocks: int  # first blocks pinned to L0 (and kept in L1)
    capacity_blocks: dict[Level, int]  # slots per level; an empty dict = unbounded (the contiguous cache)
    max_num_seqs: int  # live sequences at once (staging rows of the newest, still-filling block)

    @property
    def cold_zone_enabled(self) -> bool:
        return Level.DISK in self.capacity_blocks

    def footprint(self, num_tokens: int) -> Footprint:
        """Blocks a sequence of `num_tokens` committed tokens holds on each level once placement has run."""
        if not self.capacity_blocks:
            return Footprint(0, 0, 0)
        full = num_tokens // self.block_size
        window = self.active_window_tokens // self.block_size
        sinks = self.num_sink_blocks
        device = min(full, window) + min(sinks, max(0, full - window))
        if not self.cold_zone_enabled:
            return Footprint(device, full, 0)
        warm = window + self.warm_tokens // self.block_size
        host = min(full, warm) + min(sinks, max(0, full - warm))
        return Footprint(device, host, full - host)

    def usage(self, running: Iterable[int], parked: Iterable[int] = ()) -> dict[Level, int]:
        """Blocks per level for sequences of the given token counts; `parked` ones hold nothing in L0."""
        total = {level: 0 for level in self.capacity_blocks}
        for num_tokens, on_device in [(n, True) for n in running] + [(n, False) for n in parked]:
            fp = self.footprint(num_tokens)
            for level in total:
                if level != Level.DEVICE or on_device:
                    total[level] += fp.on(level)
        return total

    def overflow(self, usage: dict[Level, int], reserve: dict[Level, int] | None = None) -> Level | None:
        """The first level whose usage (plus `reserve` blocks kept free) exceeds its capacity, or None."""
        for level, used in usage.items():
            if used + (reserve or {}).get(level, 0) > self.capacity_blocks[level]:
                return level
        return None

    def watermark(self) -> dict[Level, int]:
        """Blocks kept free when admitting, so a newcomer does not force a preemption on the next step."""
        return {level: max(1, cap // 100) for level, cap in self.capacity_blocks.items()}

    def unfit_reason(self, num_tokens: int, reserve: dict[Level, int] | None = None) -> str | None:
        """Why one sequence of `num_tokens` tokens could never fit, even alone (with `reserve` blocks kept free
        for a step's transient needs); None when it can."""
        fp = self.footprint(num_tokens)
        for level, cap in self.capacity_blocks.items():
            needed = fp.on(level) + (reserve or {}).get(level, 0)
            if needed > cap:
                return (
                    f"a sequence of {num_tokens} tokens needs {needed} KV blocks on {TIER_NAMES[level]} but "
                    f"that level holds {cap}; send a shorter request or raise {_SETTING_TO_RAISE[level]}"
                )
        return None
