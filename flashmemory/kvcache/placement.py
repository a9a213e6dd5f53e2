"""Placement: moves blocks between levels as the PlacementPolicy says, and makes room when a level
is full.

After each commit, blocks the policy no longer wants in L0 drop their L0 copy (the FP16 L1 master
copy stays), and blocks it wants on a level below are re-encoded there from their copy and leave
the level above (L1, then each level in turn down the hierarchy). Pinned blocks never move.
Preemption demotes a whole sequence (every L0 copy dropped) and promotes it back, re-quantized from
FP16, so it reads exactly what it read before. A full level demotes the oldest movable block of any
sequence to the level below; if none can move, CapacityError says which setting to change. Levels
are known by position (manager/hierarchy.py): L0 holds hot copies, L1 the masters, and nothing here
names a level below them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from flashmemory.errors import CapacityError, FlashMemoryError
from flashmemory.kvcache.config import KV_DTYPE
from flashmemory.kvcache.levels.protocol import StorageLevel
from flashmemory.kvcache.manager.blocks import BlockEntry, BlockManager, Level
from flashmemory.kvcache.manager.hierarchy import LevelSpec, level_label
from flashmemory.kvcache.manager.policy import Locality, PlacementPolicy
from flashmemory.kvcache.quant import Codec

if TYPE_CHECKING:
    from flashmemory.kvcache.locality import LocalityPlacer

HOT, MASTER = Level.DEVICE, Level.HOST  # where the hot copies and the FP16 master copies live


def route(source: int | str, dest: int) -> tuple[str, str]:
    """A bytes-moved counter's key: ("L1", "L2"), ("new", "L0")."""
    return source if isinstance(source, str) else level_label(source), level_label(dest)


class Placement:
    """Owns the data moves between levels and the bytes-moved counters."""

    def __init__(self, policy: PlacementPolicy, blocks: BlockManager,
                 levels: dict[int, StorageLevel], codecs: dict[int, Codec],
                 specs: tuple[LevelSpec, ...],
                 cached_slots: dict[int, int | None] | None = None,
                 locality: LocalityPlacer | None = None) -> None:
        self.policy = policy
        self.locality = locality  # placement_policy="locality": the measured ALIs and the link
        # Per level, the slots unused cached blocks may keep there (absent or None: no limit but
        # the level's size).
        self.cached_slots = cached_slots or {}
        self.blocks = blocks
        self.levels = levels
        self.codecs = codecs
        self.specs = specs
        self._targets: dict[frozenset[int], int] = {}  # wanted levels -> the one a block lives on
        routes = (route(HOT, MASTER), route(MASTER, MASTER + 1), route("new", HOT),
                  route("new", MASTER))
        self.bytes_moved: dict[tuple[str, str], int] = dict.fromkeys(routes, 0)

    def _count(self, key: tuple[str, str], nbytes: int) -> None:
        self.bytes_moved[key] = self.bytes_moved.get(key, 0) + nbytes

    def count_dropped_hot_copy(self) -> None:
        """An L0 copy dropped elsewhere (the device budget's shrink), counted as a demotion is."""
        self._count(route(HOT, MASTER), self.levels[HOT].bytes_per_slot)

    def write_new_block(self, seq_id: int, k: torch.Tensor, v: torch.Tensor, pinned: bool) -> int:
        """A block just filled (k, v [num_layers, num_kv_heads, block_size, head_dim] in KV_DTYPE):
        its FP16 master copy goes to L1, its hot copy to L0. Returns its logical index."""
        # Take both slots before the block enters the table, so a full level leaves no half-placed
        # block behind.
        host_slot = self.allocate(MASTER)
        try:
            device_slot = self.allocate(HOT)
        except CapacityError:
            self.blocks.allocators[MASTER].free(host_slot)
            raise
        host, device = self.levels[MASTER], self.levels[HOT]
        host.put(host_slot, self.codecs[MASTER].encode(k, v))
        device.put(device_slot, self.codecs[HOT].encode(k, v))
        index = self.blocks.append_block(seq_id, pinned=pinned)
        self.blocks.attach(seq_id, index, MASTER, host_slot)
        self.blocks.attach(seq_id, index, HOT, device_slot)
        self._count(route("new", MASTER), host.bytes_per_slot)
        self._count(route("new", HOT), device.bytes_per_slot)
        return index

    def wanted_levels(self, seq_id: int, index: int) -> frozenset[int]:
        """The levels the policy wants block `index` of the sequence on: for a block shared with
        other sequences (a reused prefix), every level any of them wants it on."""
        block = self.blocks.tables[seq_id].blocks[index]
        wanted: frozenset[int] = frozenset()
        for owner in block.owners:
            table = self.blocks.tables.get(owner) if isinstance(owner, int) else None
            if table is not None:
                wanted |= self.policy.levels_for(len(table.blocks) - 1 - index, block.pinned)
        return wanted

    def place(self, seq_id: int) -> None:
        """Move each block of the sequence to the levels the policy wants it on: by its age, and
        with placement_policy="locality" by its access locality too (raised to L0 or kept in L1
        while the levels have free slots and the link is not saturated; sunk early)."""
        table = self.blocks.tables[seq_id]
        n = len(table.blocks)
        roles = self.locality.roles(seq_id, table) if self.locality is not None else {}
        for i, block in enumerate(table.blocks):
            if block.pinned:
                continue
            role = roles.get(i)
            shared = len(block.owners) > 1
            wanted = (self.wanted_levels(seq_id, i) if shared
                      else self.policy.levels_for(n - 1 - i, False))
            if role is not None and not (shared and role is Locality.SINK):
                by_role = self.policy.levels_for_role(n - 1 - i, False, role)
                wanted = wanted | by_role if shared else by_role
                if role is not Locality.SINK:
                    self._raise(seq_id, i, wanted)
            if HOT in block.slots and HOT not in wanted:
                self._demote_from_device(seq_id, i)
            # The fastest level wanted below L0 is where the block lives (a shared block: as its
            # youngest user).
            target = self._targets.get(wanted)
            if target is None:
                below_hot = (lv for lv in wanted if lv != HOT)
                target = self._targets[wanted] = min(below_hot, default=HOT)
            while target > MASTER and target in self.levels and MASTER <= block.primary < target:
                self._demote_to(seq_id, i, target)
                if role is Locality.SINK:
                    self.locality.count_sink()

    def restore(self, seq_id: int, num_blocks: int) -> None:
        """Bring the first `num_blocks` blocks (a reused prefix) up to the levels the policy wants
        them on: an FP16 L1 copy decoded from a level below where only that is left, an L0 copy
        re-quantized from L1."""
        for i in range(num_blocks):
            self.restore_block(seq_id, i)

    def _raise(self, seq_id: int, index: int, wanted: frozenset[int]) -> None:
        """Locality's promotion: the copies `wanted` asks for that the block lacks, only into free
        slots (never pushing another block down) and never while the link is saturated."""
        block = self.blocks.tables[seq_id].blocks[index]
        base = min(lv for lv in block.slots if lv != HOT)
        missing = [lv for lv in wanted if lv not in block.slots and (lv == HOT or lv < base)]
        if not missing or not self.locality.may_move():
            return
        if any(self.blocks.allocators[lv].num_free == 0 for lv in missing):
            return
        self.restore_block(seq_id, index, wanted)
        self.locality.count_raise(HOT in missing)
        if HOT in missing:
            self._count(route(self.source_copy(block), HOT), self.levels[HOT].bytes_per_slot)

    def restore_block(self, seq_id: int, index: int,
                      wanted: frozenset[int] | None = None) -> None:
        """Bring one block of a reused prefix up to the levels the policy wants it on (see
        `restore`; `wanted`: those levels, given): each wanted level it has no copy on that is
        faster than its fastest copy off L0, the slowest first, so each is made from the best copy
        there is."""
        block = self.blocks.tables[seq_id].blocks[index]
        wanted = self.wanted_levels(seq_id, index) if wanted is None else wanted
        base = min(lv for lv in block.slots if lv != HOT)
        missing = (lv for lv in wanted if lv < base and lv not in block.slots)
        for level in sorted(missing, reverse=True):
            if level == MASTER and block.kept_master_slot is not None:
                self.blocks.unkeep_master(block, into_slots=True)  # its own master, not a decode
            elif level == HOT:
                self.promote_to_device(seq_id, index)
            else:
                self._restore_to(seq_id, index, level)

    def release(self, seq_id: int, keep_cached: bool = True) -> None:
        """Free every slot the sequence holds, on every level; its named blocks stay in the prefix
        cache unless `keep_cached` is False (its KV is in doubt, e.g. after a corrupt cold
        block)."""
        for level, slot in self.blocks.free_sequence(seq_id, keep_cached):
            self.levels[level].free(slot)
        self._trim_cached()

    def _trim_cached(self) -> None:
        """Keep the copies of unused cached blocks within their budgets: beyond a level's budget
        the least recently used go to the level below when there is one, else leave the cache
        (their slots are reused first, so the cold file stays near the working set plus that
        budget)."""
        cache = self.blocks.prefix_cache
        if cache is None:
            return
        for level in sorted(self.cached_slots):
            budget = self.cached_slots[level]
            if budget is None or level not in self.levels:
                continue
            excess = self.cached_copies(level) - budget
            for _ in range(max(0, excess)):
                if not (self._evict_cached(level) or level == MASTER and self._drop_kept_master()):
                    break

    def cached_copies(self, level: int) -> int:
        """Copies on `level` only the prefix cache wants: unused blocks' copies, and on L1 the
        masters kept for live blocks that read a copy below."""
        cache = self.blocks.prefix_cache
        unused = cache.unused_copies()[level] if cache is not None else 0
        return unused + (len(self.blocks.kept_masters) if level == MASTER else 0)

    def demote_sequence(self, seq_id: int) -> int:
        """Drop every L0 copy of the sequence's blocks, pinned ones included (preemption under
        device pressure).

        Nothing is lost: every block keeps its FP16 copy in L1 (or its copy below). The
        still-filling block stays in its row. Returns the number of blocks demoted.
        """
        demoted = 0
        for index, block in enumerate(self.blocks.tables[seq_id].blocks):
            if HOT in block.slots:
                assert len(block.slots) > 1, "an L0 copy is never a block's only copy"
                self._demote_from_device(seq_id, index)
                demoted += 1
        return demoted

    def promote_sequence(self, seq_id: int) -> int:
        """Undo demote_sequence: restore the L0 copies the policy keeps (sinks, pinned spans, the
        newest window), re-quantized from the FP16 copies, so attention reads exactly what it read
        before. Returns the count."""
        table = self.blocks.tables[seq_id]
        promoted = 0
        for index, block in enumerate(table.blocks):
            hot = HOT in self.policy.levels_for(len(table.blocks) - 1 - index, block.pinned)
            if hot and HOT not in block.slots:
                self.promote_to_device(seq_id, index)
                promoted += 1
        self._count(route(MASTER, HOT), promoted * self.levels[HOT].bytes_per_slot)
        return promoted

    def source_copy(self, block: BlockEntry) -> int:
        """The copy a move reads: the most precise one off L0 (its copies are lossy caches), the
        fastest of equals."""
        return max((lv for lv in block.slots if lv != HOT),
                   key=lambda lv: (self.codecs[lv].bits, -lv))

    def _decoded(self, block: BlockEntry, level: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's keys and values from its copy on `level`, in KV_DTYPE."""
        parts = self.levels[level].read_block(block.slots[level])
        return self.codecs[level].decode(parts, KV_DTYPE)

    def _restore_to(self, seq_id: int, index: int, level: int) -> None:
        """A copy of the block on `level` (L1 or below), from a slower copy: as precise as that
        copy."""
        block = self.blocks.tables[seq_id].blocks[index]
        source = self.source_copy(block)
        k, v = self._decoded(block, source)
        slot = self.allocate(level)
        storage = self.levels[level]
        storage.put(slot, self.codecs[level].encode(k, v))
        self.blocks.attach(seq_id, index, level, slot)
        self._count(route(source, level), storage.bytes_per_slot)

    def promote_to_device(self, seq_id: int, index: int) -> None:
        """Give block `index` an L0 copy, re-quantized from its FP16 copy when one exists (so
        promotion never compounds quantization error), else from its most precise copy below."""
        block = self.blocks.tables[seq_id].blocks[index]
        k, v = self._decoded(block, self.source_copy(block))
        slot = self.allocate(HOT)
        self.levels[HOT].put(slot, self.codecs[HOT].encode(k, v))
        self.blocks.attach(seq_id, index, HOT, slot)

    def allocate(self, level: int) -> int:
        """A free slot on `level`: a free one, else one a cached block nobody uses gives up (least
        recently used first), else one a live block's demotion frees; CapacityError when nothing
        can move."""
        slot = self.blocks.allocate(level)
        while slot is None and self._evict_cached(level):
            slot = self.blocks.allocate(level)
        while slot is None and level == MASTER and self._drop_kept_master():
            slot = self.blocks.allocate(level)
        if slot is None:
            self._make_room(level)
            slot = self.blocks.allocate(level)
        if slot is None:
            raise CapacityError(self._full_message(level))
        return slot

    def _evict_cached(self, level: int) -> bool:
        """Drop one unused cached block's copy on `level`; a block with no copy below it is written
        to the level below first when there is one (the prefix cache keeps it there). False when no
        unused block has a copy there."""
        cache = self.blocks.prefix_cache
        block = cache.evictable(level) if cache is not None else None
        if block is None:
            return False
        below = level + 1
        if level >= MASTER and below in self.levels and not any(lv > level for lv in block.slots):
            try:
                self.write_copy(block, below)
            except FlashMemoryError:
                pass  # no room below (or a write error): the block leaves the cache
        for lv, slot in self.blocks.evict_cached(level):
            self.levels[lv].free(slot)
        if level == MASTER:
            self._lost_master(block)
        return True

    def write_copy(self, block: BlockEntry, level: int) -> None:
        """Give a block a copy on `level` as well (re-encoded from its most precise copy), named
        for later processes."""
        source = self.source_copy(block)
        k, v = self._decoded(block, source)
        slot = self.allocate(level)
        storage = self.levels[level]
        try:
            storage.put(slot, self.codecs[level].encode(k, v), block.block_hash or 0)
        except Exception:
            self.blocks.allocators[level].free(slot)
            raise
        block.slots[level] = slot
        self._count(route(source, level), storage.bytes_per_slot)

    def _detach(self, seq_id: int, index: int, level: int) -> None:
        self.levels[level].free(self.blocks.detach(seq_id, index, level))

    def _demote_from_device(self, seq_id: int, index: int) -> None:
        # The FP16 master copy stays in L1: dropping the L0 copy loses nothing.
        self._detach(seq_id, index, HOT)
        self._count(route(HOT, MASTER), self.levels[HOT].bytes_per_slot)

    def _demote_to(self, seq_id: int, index: int, target: int) -> None:
        """Move the block's fastest copy (L1 or below) to `target`, a slower level: re-encoded from
        it, unless the block still has its copy there (restored from it earlier)."""
        block = self.blocks.tables[seq_id].blocks[index]
        level = block.primary
        if target in block.slots:
            self._leave(seq_id, index, level)
            return
        slot = self.allocate(target)
        k, v = self._decoded(block, level)
        storage = self.levels[target]
        try:
            storage.put(slot, self.codecs[target].encode(k, v), block.block_hash or 0)
        except Exception:
            self.blocks.allocators[target].free(slot)  # the block stays where it was
            raise
        self.blocks.attach(seq_id, index, target, slot)
        self._leave(seq_id, index, level)
        self._count(route(level, target), storage.bytes_per_slot)

    def _leave(self, seq_id: int, index: int, level: int) -> None:
        """The block's sequences stop reading its copy on `level`. A named block's L1 master is
        kept for the prefix cache while L1's cached budget allows (the answer's growth ages the
        prompt's oldest L1 blocks onto L2: without it the same prompt again would compute them
        and everything after them again); otherwise it is freed."""
        block = self.blocks.tables[seq_id].blocks[index]
        if level == MASTER and self._may_keep_master(block):
            self.blocks.keep_master(block)
            return
        self._detach(seq_id, index, level)
        if level == MASTER:
            self._lost_master(block)

    def _may_keep_master(self, block: BlockEntry) -> bool:
        cache = self.blocks.prefix_cache
        named = block.block_hash is not None and cache is not None
        if not named or cache.index.get(block.block_hash) is not block:
            return False
        budget = self.cached_slots.get(MASTER)
        if budget is None or self.cached_copies(MASTER) < budget:
            return True
        # Full: the least recently used unused block's L1 copy gives way (a live block is newer).
        return budget > 0 and self._evict_cached(MASTER) and self.cached_copies(MASTER) < budget

    def _drop_kept_master(self) -> bool:
        """Free the oldest kept L1 slot (room for live blocks comes first); False when none is
        kept."""
        block = self.blocks.oldest_kept_master()
        if block is None:
            return False
        for level, slot in self.blocks.unkeep_master(block):
            self.levels[level].free(slot)
        self._lost_master(block)
        return True

    def _lost_master(self, block: BlockEntry) -> None:
        """The block's L1 copy is gone: unless a copy it keeps is as precise (an FP16 level below),
        what is left is lossier than what a prefill writes, and the prefix cache must not offer it
        where a prefill keeps L1."""
        master_bits = self.codecs[MASTER].bits
        if block.slots and all(self.codecs[lv].bits < master_bits for lv in block.slots):
            block.master_lost = True

    def _make_room(self, level: int) -> None:
        """Pressure: demote the oldest movable block of any sequence off `level` (L0: its copy
        dropped; below: moved to the next level, when there is one)."""
        if level != HOT and level + 1 not in self.levels:
            return
        victim = None
        for seq_id, table in self.blocks.tables.items():
            n = len(table.blocks)
            for i, block in enumerate(table.blocks):
                movable = not block.pinned and (
                    (level == HOT and HOT in block.slots)
                    or (level != HOT and block.primary == level))
                if movable:
                    age = n - 1 - i
                    if victim is None or age > victim[0]:
                        victim = (age, seq_id, i)
                    break  # blocks are in age order: the first movable one is the oldest
        if victim is None:
            return
        _, seq_id, i = victim
        if level == HOT:
            self._demote_from_device(seq_id, i)
        else:
            self._demote_to(seq_id, i, level + 1)

    def _full_message(self, level: int) -> str:
        message = self.specs[level].full_message
        if level == MASTER and level + 1 not in self.levels:
            message += " or set cold_zone_enabled=True"
        return message
