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
from enum import Enum
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


class Locality(Enum):
    """What a block's access-locality index (ALI) asks of its placement (LocalityPolicy.roles)."""

    DEVICE = "device"  # chosen nearly every step: an L0 copy beside its L1 one
    HOST = "host"  # chosen often: its L1 copy stays, however old
    SINK = "sink"  # never chosen over a full history: it leaves L1 early


# The seed's bands (seed 004 section 5): ALI > 0.7 -> device, 0.3-0.7 -> host, below -> by age;
# a block no choice picked over a full history as a candidate sinks. A band also asks for LIFT
# times the share a block chosen at random would have: with a selection budget near 30 % of the
# candidates (short histories, selection_min_tokens) every block would pass 0.3 by chance.
DEVICE_ALI = 0.7
HOST_ALI = 0.3
LIFT = 2.0


@dataclass(frozen=True)
class BlockLocality:
    """A block's access-locality index over its last steps as a selection candidate."""

    ali: float  # the share of its (layer, KV head) choices that picked it, over those steps
    steps: int  # steps it was a candidate in, within the history window
    history_steps: int  # the window's length
    base: float = 0.0  # the share a block chosen at random would have had (budget / candidates)

    def above(self, threshold: float) -> bool:
        """In a band: over `threshold`, and LIFT times the random share."""
        return self.ali > threshold and self.ali > LIFT * self.base


@dataclass(frozen=True)
class LocalityPolicy(PlacementPolicy):
    """The age rule, and on top of it placement by access locality: blocks selection keeps choosing
    get an L0 copy (up to `device_blocks` a sequence) or keep their L1 copy past their age (up to
    `host_blocks`), blocks no choice picked over a full history leave L1 for the level below at
    once. The extra copies are counted in `footprint`, so the scheduler's capacity checks reserve
    them; `footprint` stays an upper bound (sinking only frees L1)."""

    device_blocks: int = 0  # a sequence's old blocks with an L0 copy by locality, at most
    host_blocks: int = 0  # a sequence's blocks kept in L1 past their age by locality, at most

    def roles(self, num_blocks: int, locality: dict[int, BlockLocality],
              pinned: set[int] | frozenset[int] = frozenset()) -> dict[int, Locality]:
        """Which blocks of a sequence of `num_blocks` full blocks locality places, from their
        measured locality, the highest ALIs first within each budget (a block the device budget
        leaves out still stays in L1): DEVICE and HOST as the bands say, SINK for blocks in L1's
        age band (past the window, not yet past warm_tokens) no choice picked over a full history,
        the oldest first, as many as `host_blocks` (kept blocks trade places with sunk ones)."""
        out: dict[int, Locality] = {}
        device_left, host_left, sink_left = self.device_blocks, self.host_blocks, self.host_blocks
        window_start = num_blocks - self.window_blocks  # blocks from it on are in the window
        warm_start = num_blocks - self.warm_end_blocks  # blocks before it are past L1 by age
        cold = self.cold_zone_enabled
        for index, seen in sorted(locality.items(), key=lambda item: (-item[1].ali, item[0])):
            if index in pinned or index >= window_start:
                continue
            if seen.above(DEVICE_ALI) and device_left > 0:
                out[index], device_left = Locality.DEVICE, device_left - 1
            elif seen.above(HOST_ALI) and cold and index < warm_start and host_left > 0:
                out[index], host_left = Locality.HOST, host_left - 1
        for index in sorted(locality):
            seen = locality[index]
            if (cold and sink_left > 0 and warm_start <= index < window_start
                    and index not in pinned and seen.ali == 0
                    and seen.steps >= seen.history_steps):
                out[index], sink_left = Locality.SINK, sink_left - 1
        return out

    def levels_for_role(self, age: int, pinned: bool, role: Locality | None) -> frozenset[int]:
        """The levels a block `age` blocks old holds a copy on, given its locality role (None: the
        age rule)."""
        by_age = self.levels_for(age, pinned)
        if pinned or role is None or age < self.window_blocks:
            return by_age
        if role is Locality.DEVICE:
            return HOT
        if role is Locality.HOST:
            return by_age if Level.HOST in by_age else frozenset({Level.HOST})
        # SINK: the level after L1, or where the age rule has it already
        below = self._below_window[1][1] if len(self._below_window) > 1 else by_age
        return by_age if Level.HOST not in by_age else below

    def footprint(self, num_tokens: int, pinned_spans: Iterable[tuple[int, int]] = ()) -> Footprint:
        """The age rule's blocks per level plus the copies locality may add: L0 copies of up to
        `device_blocks` older blocks, L1 copies of up to `device_blocks + host_blocks` blocks past
        L1's age, and on the level after L1 up to `host_blocks` blocks sunk early."""
        base = super().footprint(num_tokens, pinned_spans)
        n = num_tokens // self.block_size
        counts = list(base.blocks)
        old = max(0, n - self.window_blocks - self.num_sink_blocks)
        counts[Level.DEVICE] += min(self.device_blocks, old)
        if self.cold_zone_enabled and len(counts) > Level.DISK:
            past_host = max(0, n - self.warm_end_blocks - self.num_sink_blocks)
            counts[Level.HOST] += min(self.host_blocks + self.device_blocks, past_host)
            warm_band = max(0, min(n, self.warm_end_blocks) - self.window_blocks)
            counts[Level.DISK] += min(self.host_blocks, warm_band)
        return Footprint(tuple(counts))


# placement_policy's choices -> the class that carries the rule
PLACEMENT_POLICIES: dict[str, type[PlacementPolicy]] = {"age": PlacementPolicy,
                                                        "locality": LocalityPolicy}
