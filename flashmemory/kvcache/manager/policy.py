"""PlacementPolicy: the one copy of the rule that says which KV levels hold a copy of each block (no torch).

A sequence's full blocks age as it grows (age 0 = its newest full block). Pinned blocks (the attention sinks
and blocks overlapping a pinned span) and the newest `active_window` tokens of blocks have a copy in L0 and their
FP16 master copy in L1; blocks older than that keep only the L1 copy until they are `warm_tokens` older than the
window, then live in L2 alone. Without a cold level every old block stays in L1. The cache moves blocks by asking
`levels_for`; the scheduler counts what a sequence will hold with `footprint`, computed from the same rule.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from flashmemory.kvcache.manager.blocks import Level

HOT = frozenset({Level.DEVICE, Level.HOST})
WARM = frozenset({Level.HOST})
COLD = frozenset({Level.DISK})


@dataclass(frozen=True)
class Footprint:
    """Blocks one sequence holds per level (a level absent from the cache counts 0)."""

    device_blocks: int
    host_blocks: int
    disk_blocks: int

    def on(self, level: Level) -> int:
        return (self.device_blocks, self.host_blocks, self.disk_blocks)[int(level)]


@dataclass(frozen=True)
class PlacementPolicy:
    """Where each full block of a sequence lives, from its age, whether it is pinned and whether L2 exists."""

    block_size: int  # tokens per block
    active_window_tokens: int  # newest tokens kept in L0
    warm_tokens: int  # tokens after the window kept in L1 when a cold level exists
    num_sink_blocks: int  # first blocks pinned to L0 (attention sinks)
    cold_zone_enabled: bool  # False: every old block stays in L1

    @property
    def window_blocks(self) -> int:
        return self.active_window_tokens // self.block_size

    @property
    def warm_end_blocks(self) -> int:
        """Age (in blocks) from which a block leaves L1 for L2."""
        return self.window_blocks + self.warm_tokens // self.block_size

    def levels_for(self, age: int, pinned: bool) -> frozenset[Level]:
        """The levels that hold a copy of a full block `age` blocks older than the newest one."""
        if pinned or age < self.window_blocks:
            return HOT
        if not self.cold_zone_enabled or age < self.warm_end_blocks:
            return WARM
        return COLD

    def keeps_master(self, index: int, num_blocks: int) -> bool:
        """Whether block `index` of a sequence of `num_blocks` full blocks keeps its L1 master copy (is not on L2
        only): a prefill that has computed `num_blocks` blocks reads it in FP16."""
        return Level.DISK not in self.levels_for(num_blocks - 1 - index, self.is_pinned(index))

    def is_pinned(self, index: int, pinned_spans: Iterable[tuple[int, int]] = ()) -> bool:
        """Whether block `index` is pinned: an attention sink, or overlapping a [start, end) token span."""
        start, end = index * self.block_size, (index + 1) * self.block_size
        return index < self.num_sink_blocks or any(a < end and start < b for a, b in pinned_spans)

    def span_blocks(self, start: int, end: int, num_blocks: int) -> range:
        """Indices of the blocks among the first `num_blocks` that overlap tokens [start, end)."""
        return range(start // self.block_size, min(num_blocks, -(-end // self.block_size)))

    def pinned_blocks(self, num_blocks: int, pinned_spans: Iterable[tuple[int, int]] = ()) -> set[int]:
        """Indices of the pinned blocks among the first `num_blocks`."""
        out = set(range(min(self.num_sink_blocks, num_blocks)))
        for a, b in pinned_spans:
            out.update(self.span_blocks(a, b, num_blocks))
        return out

    def footprint(self, num_tokens: int, pinned_spans: Iterable[tuple[int, int]] = ()) -> Footprint:
        """Blocks a sequence of `num_tokens` committed tokens holds on each level once placement has run
        (the still-filling block lives in its own row, not a slot)."""
        n = num_tokens // self.block_size
        pinned = self.pinned_blocks(n, pinned_spans)
        # A pinned block outside the span that a level keeps anyway is an extra copy on it.
        device = min(n, self.window_blocks) + sum(1 for i in pinned if i <= n - 1 - self.window_blocks)
        if not self.cold_zone_enabled:
            return Footprint(device, n, 0)
        host = min(n, self.warm_end_blocks) + sum(1 for i in pinned if i <= n - 1 - self.warm_end_blocks)
        return Footprint(device, host, n - host)
