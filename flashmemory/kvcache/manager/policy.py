"""PlacementPolicy: the one copy of the rule that says which KV levels hold a copy of each block (no torch).

A sequence's full blocks age as it grows (age 0 = its newest full block). Pinned blocks (the attention sinks
and blocks overlapping a pinned span) and the newest `active_window` tokens of blocks have a copy in L0 and their
FP16 master copy in L1; blocks older than that keep only the L1 copy until they are `warm_tokens` older than the
window, then live on the next level alone, and so on down the hierarchy: a block leaves each level
below L1 once it is that level's `keep_tokens` older than when it arrived there, and the last level
keeps it. Without a level below L1 every old block stays in L1. The cache moves blocks by asking
`levels_for`; the scheduler counts what a sequence will hold with `footprint`, computed from the
same rule.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property

from flashmemory.kvcache.manager.blocks import Level, as_level

HOT = frozenset({Level.DEVICE, Level.HOST})


@dataclass(frozen=True)
class Footprint:
    """Blocks one sequence holds per level, in level order (a level absent from the cache counts
    0)."""

    blocks: tuple[int, ...]

    def on(self, level: int) -> int:
        return self.blocks[level] if level < len(self.blocks) else 0

    @property
    def device_blocks(self) -> int:
        return self.on(Level.DEVICE)

    @property
    def host_blocks(self) -> int:
        return self.on(Level.HOST)

    @property
    def disk_blocks(self) -> int:
        return self.on(Level.DISK)


@dataclass(frozen=True)
class PlacementPolicy:
    """Where each full block of a sequence lives, from its age, whether it is pinned and the levels
    there are."""

    block_size: int  # tokens per block
    active_window_tokens: int  # newest tokens kept in L0
    warm_tokens: int  # tokens after the window kept in L1 when a level below it exists
    num_sink_blocks: int  # first blocks pinned to L0 (attention sinks)
    cold_zone_enabled: bool  # a level below L1 exists (the cold zone by default); False: none
    # Per level below L1 but the last, in order: the tokens a block stays on it before moving on.
    keep_tokens: tuple[int, ...] = ()

    @property
    def window_blocks(self) -> int:
        return self.active_window_tokens // self.block_size

    @property
    def warm_end_blocks(self) -> int:
        """Age (in blocks) from which a block leaves L1 for the level below."""
        return self.window_blocks + self.warm_tokens // self.block_size

    @cached_property
    def level_ends(self) -> tuple[int | None, ...]:
        """Per level, the age (in blocks) from which no block is kept there (None: the last level
        keeps them); L1 starts at age 0, as it keeps the master copies of L0's blocks, every level
        below where the one above ends."""
        if not self.cold_zone_enabled:
            return self.window_blocks, None
        ends: list[int | None] = [self.window_blocks, self.warm_end_blocks]
        for tokens in self.keep_tokens:
            ends.append(ends[-1] + tokens // self.block_size)
        return (*ends, None)

    @cached_property
    def _below_window(self) -> tuple[tuple[float, frozenset[int]], ...]:
        """From L1 on, each level's end (the last: infinite) and the set of that level only, made
        once: levels_for runs for every block at every step."""
        return tuple((math.inf if end is None else end, frozenset({as_level(level)}))
                     for level, end in enumerate(self.level_ends) if level >= Level.HOST)

    @property
    def num_levels(self) -> int:
        return len(self.level_ends)

    def levels_for(self, age: int, pinned: bool) -> frozenset[int]:
        """The levels that hold a copy of a full block `age` blocks older than the newest one."""
        if pinned or age < self.window_blocks:
            return HOT
        for end, alone in self._below_window:
            if age < end:
                return alone
        raise AssertionError("the last level keeps every block")  # its end is infinite

    def keeps_master(self, index: int, num_blocks: int) -> bool:
        """Whether block `index` of a sequence of `num_blocks` full blocks keeps its L1 master copy
        (is not on a level below only): a prefill that has computed `num_blocks` blocks reads it in
        FP16."""
        return Level.HOST in self.levels_for(num_blocks - 1 - index, self.is_pinned(index))

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

        def younger(end: int | None) -> int:  # blocks younger than age `end`
            return n if end is None else min(n, end)

        def pinned_older(end: int | None) -> int:  # pinned blocks at least `end` old: kept hot
            return 0 if end is None else sum(1 for i in pinned if i <= n - 1 - end)

        ends = self.level_ends
        # L0 and L1 hold every block younger than their end, and the pinned blocks older than that
        # on top.
        counts = [younger(end) + pinned_older(end) for end in ends[:2]]
        for start, end in zip(ends[1:], ends[2:]):  # a level below: its ages, less pinned blocks
            pinned_here = pinned_older(start) - pinned_older(end)
            counts.append(younger(end) - younger(start) - pinned_here)
        return Footprint(tuple(counts))
