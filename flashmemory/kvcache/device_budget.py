"""DeviceBudget: the L0 budget at run time — how many slots of the preallocated L0 pool may hold blocks — and the
share of attention reads L0 serves (what the DynamicBudgetController, engine/budget_controller.py, steers by).

Shrinking demotes: a block on a slot above the new limit moves to a free slot below it, or, when none is free, the
oldest unpinned L0 copy of any sequence is dropped to make one (its FP16 copy in L1, or its L2 copy, stays: nothing
is lost, no sequence is dropped). Growing promotes: blocks the placement policy wants in L0 that lost their L0
copy under pressure get it back, re-quantized from FP16, newest first. A sequence with no L0 copy at all is parked
by the scheduler; its promotion is the scheduler's.

Device memory follows the limit in whole segments (levels/device_arena.py): after a shrink's moves the arena
gives back the segments above the limit (and above any pinned block that could not move), and a grow takes them
again before promoting, never beyond the pool preallocated at start-up (max_gpu_memory_mb's share). A grow the
device cannot serve (another process took the memory) stops at what the arena holds. An L0 medium that is not a
DeviceArena keeps its full size; only the limit moves.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from flashmemory.kvcache.attention.backend import AttentionBackend, DecodeBatch, LevelRead
from flashmemory.kvcache.levels.device_arena import DeviceArena
from flashmemory.kvcache.manager.blocks import Level
from flashmemory.kvcache.manager.slot_limit import LimitedSlotAllocator


@dataclass(frozen=True)
class ResizeResult:
    """What one resize did."""

    limit_slots: int  # the limit in effect afterwards
    relocated: int  # blocks copied from a slot above the limit to a free one below
    demoted: int  # L0 copies dropped (their other copy stays)
    promoted: int  # L0 copies restored
    allocated_bytes: int  # device bytes the L0 storage holds afterwards


class ReadCounter:
    """An attention backend in front of another that counts the blocks decode steps read from each level (per KV
    head: a block read by every head counts once per head).

    The FP16 rows of the newest tokens (recent_rows.py: the filling block, recent_fp16_tokens' full blocks, the
    sinks) live in device memory and stand in for those blocks' L0 copies, so they count as L0 reads (in
    `row_reads`, a part of `reads[Level.DEVICE]`): with the default row covering the whole window, L0 serves
    most reads through the row, not through its INT4 copies.
    """

    def __init__(self, inner: AttentionBackend, levels: Iterable[int] = tuple(Level)) -> None:
        self.inner = inner
        self.name = inner.name
        self.reads = {level: 0 for level in levels}  # per level of the cache
        self.row_reads = 0  # of reads[Level.DEVICE]: blocks attended from the FP16 rows

    def decode_batch(self, batch: DecodeBatch, reader) -> torch.Tensor:
        for seq in batch.seqs:
            heads = seq.new_k.shape[0]
            for r in seq.reads:
                self.reads[r.level] += r.num_blocks * heads
            # row [2, heads, m, head_dim] (sinks, recent blocks, filling block) and the new token:
            # whole blocks and the partial one, each read by every head.
            row_tokens = seq.row.shape[2] + seq.new_k.shape[1]
            row_blocks = -(-row_tokens // reader.cfg.block_size) * heads
            self.reads[Level.DEVICE] += row_blocks
            self.row_reads += row_blocks
        return self.inner.decode_batch(batch, reader)

    def prefill(self, layer, q, filling, new_k, new_v, reads: list[LevelRead], reader):
        return self.inner.prefill(layer, q, filling, new_k, new_v, reads, reader)


def read_counter(cache) -> ReadCounter:
    """The cache's ReadCounter, put in front of its attention backend if it has none (or the backend changed)."""
    if not isinstance(cache.attention, ReadCounter):
        cache.attention = ReadCounter(cache.attention, cache.levels)
    return cache.attention


class DeviceBudget:
    """Owns the limit on a tiered cache's L0 allocator and the moves that follow a change of it."""

    def __init__(self, cache) -> None:
        self.cache = cache
        blocks = cache.blocks
        allocator = blocks.allocators[Level.DEVICE]
        if not isinstance(allocator, LimitedSlotAllocator):
            if allocator.num_used:
                raise RuntimeError("attach the device budget before any block is written")  # engine start-up only
            allocator = blocks.allocators[Level.DEVICE] = LimitedSlotAllocator(allocator.num_slots)
        self.allocator = allocator
        self.device = cache.levels[Level.DEVICE]
        self.policy = cache.policy
        read_counter(cache)

    @property
    def full_slots(self) -> int:
        return self.allocator.physical_slots

    @property
    def limit_slots(self) -> int:
        return self.allocator.limit

    @property
    def min_slots(self) -> int:
        """The fewest slots one sequence's window and attention sinks need (a smaller limit could never run it)."""
        return min(self.full_slots, self.policy.window_blocks + self.policy.num_sink_blocks)

    @property
    def slot_bytes(self) -> int:
        return self.device.bytes_per_slot

    @property
    def allocated_bytes(self) -> int:
        """Device bytes L0's storage holds now (counted by the arena; the full pool for another medium)."""
        if isinstance(self.device, DeviceArena):
            return self.device.allocated_bytes
        return self.device.capacity_bytes

    def read_counts(self) -> tuple[int, int]:
        """(blocks read from L0, its FP16 rows included, blocks read from every level) by decode steps so far."""
        reads = read_counter(self.cache).reads
        return reads[Level.DEVICE], sum(reads.values())

    def resize(self, num_slots: int) -> ResizeResult:
        """Let L0 use `num_slots` slots (clamped to [min_slots, full_slots]); moves blocks as the module says."""
        limit = max(self.min_slots, min(self.full_slots, num_slots))
        if limit >= self.limit_slots:
            limit = max(self.limit_slots, min(limit, self._fit_arena(limit)))  # memory first: it may fall short
            self.allocator.set_limit(limit)
            return ResizeResult(limit, 0, 0, self._promote_hot_blocks(), self.allocated_bytes)
        self.allocator.set_limit(limit)
        relocated = demoted = 0
        demoted += self._drop_cached_above_limit()
        for slot in self.allocator.used_above_limit():
            seq_id, index = self._owner(slot)
            table = self.cache.blocks.tables[seq_id]
            if self.allocator.num_free == 0:
                victim = self._oldest_below_limit()
                if not table.blocks[index].pinned and (victim is None or len(table.blocks) - 1 - index >= victim[0]):
                    self._drop(seq_id, index)  # it is the oldest movable copy itself
                    demoted += 1
                    continue
                if victim is None:
                    continue  # pinned, and nothing below the limit can move: it keeps its slot for now
                self._drop(victim[1], victim[2])
                demoted += 1
            self._relocate(seq_id, index, slot)
            relocated += 1
        self._fit_arena(limit)
        return ResizeResult(self.limit_slots, relocated, demoted, 0, self.allocated_bytes)

    def _fit_arena(self, limit: int) -> int:
        """Size L0's storage for slots [0, limit) and every used slot; returns the slots it holds."""
        if not isinstance(self.device, DeviceArena):
            return self.full_slots
        used = self.allocator.used_slots()
        return self.device.fit(max([limit, *(s + 1 for s in used)]), used)

    # ---- moves ------------------------------------------------------------------------------------------------

    def _drop_cached_above_limit(self) -> int:
        """Cached blocks nobody uses give up their L0 copies above the limit first (they are a cache)."""
        cache = self.cache.blocks.prefix_cache
        if cache is None:
            return 0
        dropped = 0
        for block in cache.unused_blocks():
            slot = block.slots.get(Level.DEVICE)
            if slot is not None and slot >= self.limit_slots:
                del block.slots[Level.DEVICE]
                self.allocator.free(slot)
                self.device.free(slot)
                cache.dropped_copy(block, Level.DEVICE)
                dropped += 1
        return dropped

    def _owner(self, slot: int) -> tuple[int, int]:
        for seq_id, table in self.cache.blocks.tables.items():
            for index, block in enumerate(table.blocks):
                if block.slots.get(Level.DEVICE) == slot:
                    return seq_id, index
        raise AssertionError(f"used L0 slot {slot} belongs to no block")  # bookkeeping bug

    def _relocate(self, seq_id: int, index: int, old: int) -> None:
        new = self.allocator.allocate()
        assert new is not None and new < self.limit_slots
        self.device.put(new, self.device.read_block(old))
        self.cache.blocks.detach(seq_id, index, Level.DEVICE)  # the old slot is withheld: above the limit
        self.device.free(old)
        self.cache.blocks.attach(seq_id, index, Level.DEVICE, new)

    def _drop(self, seq_id: int, index: int) -> None:
        # The block keeps its other copy (FP16 in L1, or L2): dropping the L0 one loses nothing.
        block = self.cache.blocks.tables[seq_id].blocks[index]
        assert len(block.slots) > 1, "an L0 copy is never a block's only copy"
        self.device.free(self.cache.blocks.detach(seq_id, index, Level.DEVICE))
        self.cache.placement.count_dropped_hot_copy()

    def _oldest_below_limit(self) -> tuple[int, int, int] | None:
        """(age, seq_id, index) of the oldest unpinned L0 copy on a slot below the limit, as pressure picks."""
        victim = None
        for seq_id, table in self.cache.blocks.tables.items():
            n = len(table.blocks)
            for index, block in enumerate(table.blocks):
                slot = block.slots.get(Level.DEVICE)
                if slot is None or block.pinned or slot >= self.limit_slots:
                    continue
                if victim is None or n - 1 - index > victim[0]:
                    victim = (n - 1 - index, seq_id, index)
                break  # blocks are in age order: the first one is this sequence's oldest
        return victim

    def _promote_hot_blocks(self) -> int:
        """Give back L0 copies the policy wants and pressure took, newest first, while free slots last."""
        wanted = []
        for seq_id, table in self.cache.blocks.tables.items():
            if not table.copies_on(Level.DEVICE):
                continue  # parked: the scheduler promotes it when it resumes
            n = len(table.blocks)
            for index, block in enumerate(table.blocks):
                age = n - 1 - index
                if Level.DEVICE not in block.slots and Level.DEVICE in self.policy.levels_for(age, block.pinned):
                    wanted.append((age, seq_id, index))
        promoted = 0
        for _, seq_id, index in sorted(wanted):
            if self.allocator.num_free == 0:
                break
            self.cache.placement.promote_to_device(seq_id, index)
            promoted += 1
        return promoted
