"""KVCapacity: the slots each KV level has and whether a set of sequences fits them (no torch).

The scheduler asks it whether a step fits before running it, as vLLM's scheduler asks `allocate_slots`: the
blocks each sequence will hold on each level come from the cache's own PlacementPolicy (`footprint`), so the
scheduler never keeps a model of the cache's rules. A cache without levels (the contiguous baseline) has no
policy and unbounded capacity: only the number of live sequences is bounded.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from flashmemory.kvcache.manager.blocks import Level
from flashmemory.kvcache.manager.hierarchy import BUILT_IN_NAMES, LevelSpec, level_label
from flashmemory.kvcache.manager.policy import Footprint, PlacementPolicy
from flashmemory.kvcache.manager.prefix_cache import PrefixCache
Spans = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class SequenceLoad:
    """What one sequence holds, for capacity checks: its committed tokens and pinned token spans."""

    num_tokens: int
    pinned_spans: Spans = ()
    on_device: bool = True  # False while parked (demoted): it holds nothing in L0


@dataclass(frozen=True)
class KVCapacity:
    """Capacity of every level in blocks, and the placement policy that fills them."""

    policy: PlacementPolicy | None  # None: a cache without levels (nothing but sequences is bounded)
    capacity_blocks: dict[Level, int] = field(default_factory=dict)  # slots per level
    max_num_seqs: int = 1  # live sequences at once (each has a row for its newest, still-filling block)
    prefix_cache: PrefixCache | None = None  # the named blocks a new sequence may reuse
    levels: tuple[LevelSpec, ...] = ()  # how messages name each level (empty: the built-in names)

    def cached_prefix_tokens(self, token_ids: list[int]) -> int:
        """How many leading tokens of a new sequence the prefix cache holds (full blocks, never the last token):
        their prefill is skipped. Nothing is counted or reserved."""
        if self.prefix_cache is None or len(token_ids) <= self.block_size:
            return 0
        needs_master = None if self.policy is None else self.policy.keeps_master
        found = self.prefix_cache.match(token_ids, (len(token_ids) - 1) // self.block_size, count=False,
                                        needs_master=needs_master)
        return len(found) * self.block_size

    @property
    def block_size(self) -> int:
        return self.policy.block_size if self.policy is not None else 16

    @property
    def cold_zone_enabled(self) -> bool:
        """Whether a level below L1 exists (the cold zone by default): L1 can give blocks to it."""
        return any(level > Level.HOST for level in self.capacity_blocks)

    def footprint(self, num_tokens: int, pinned_spans: Iterable[tuple[int, int]] = ()) -> Footprint:
        if self.policy is None:
            return Footprint(())
        return self.policy.footprint(num_tokens, pinned_spans)

    def usage(self, loads: Iterable[SequenceLoad]) -> dict[Level, int]:
        """Blocks per level the given sequences hold."""
        total = {level: 0 for level in self.capacity_blocks}
        for load in loads:
            fp = self.footprint(load.num_tokens, load.pinned_spans)
            for level in total:
                if level != Level.DEVICE or load.on_device:
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

    def unfit_reason(self, num_tokens: int, reserve: dict[Level, int] | None = None,
                     pinned_spans: Iterable[tuple[int, int]] = ()) -> str | None:
        """Why one sequence of `num_tokens` tokens could never fit, even alone (with `reserve` blocks kept free
        for a step's transient needs); None when it can."""
        fp = self.footprint(num_tokens, pinned_spans)
        for level, cap in self.capacity_blocks.items():
            needed = fp.on(level) + (reserve or {}).get(level, 0)
            if needed > cap:
                hint = " or set cold_zone_enabled=True" if level == Level.HOST and not self.cold_zone_enabled else ""
                pool, setting = self._names(level)
                return (
                    f"the {pool} KV pool is full for this request: a sequence of {num_tokens} "
                    f"tokens needs {needed} KV blocks on {level_label(level)} but that level "
                    f"holds {cap}; send a shorter request or raise {setting}{hint}"
                )
        return None

    def _names(self, level: int) -> tuple[str, str]:
        """(pool name, setting to raise) of a level, from its spec (else the built-in names)."""
        if level < len(self.levels):
            return self.levels[level].pool_name, self.levels[level].capacity_setting
        return BUILT_IN_NAMES[level]
