"""Placement: moves blocks between levels as the PlacementPolicy says, and makes room when a level is full.

After each commit, blocks the policy no longer wants in L0 drop their L0 copy (the FP16 L1 master copy stays), and
blocks it wants in L2 are re-encoded from FP16 and leave L1. Pinned blocks never move. Preemption demotes a whole
sequence (every L0 copy dropped) and promotes it back, re-quantized from FP16, so it reads exactly what it read
before. A full level demotes the oldest movable block of any sequence; if none can move, CapacityError says which
setting to change.
"""

from __future__ import annotations

import torch

from flashmemory.errors import CapacityError, FlashMemoryError
from flashmemory.kvcache.config import KV_DTYPE
from flashmemory.kvcache.levels.protocol import StorageLevel
from flashmemory.kvcache.manager.blocks import BlockEntry, BlockManager, Level
from flashmemory.kvcache.manager.policy import PlacementPolicy
from flashmemory.kvcache.quant import Codec


class Placement:
    """Owns the data moves between levels and the bytes-moved counters."""

    def __init__(self, policy: PlacementPolicy, blocks: BlockManager, levels: dict[Level, StorageLevel],
                 codecs: dict[Level, Codec], cached_host_slots: int | None = None,
                 cached_disk_slots: int | None = None) -> None:
        self.policy = policy
        self.cached_host_slots = cached_host_slots  # L1 slots unused cached blocks may keep (None = no limit)
        self.cached_disk_slots = cached_disk_slots  # L2 slots they may keep (None = no limit but the file's size)
        self.blocks = blocks
        self.levels = levels
        self.codecs = codecs
        self.bytes_moved: dict[str, int] = {"L0->L1": 0, "L1->L2": 0, "new->L0": 0, "new->L1": 0}

    def write_new_block(self, seq_id: int, k: torch.Tensor, v: torch.Tensor, pinned: bool) -> int:
        """A block just filled (k, v [num_layers, num_kv_heads, block_size, head_dim] in KV_DTYPE): its FP16 master
        copy goes to L1, its hot copy to L0. Returns its logical index."""
        # Take both slots before the block enters the table, so a full level leaves no half-placed block behind.
        host_slot = self.allocate(Level.HOST)
        try:
            device_slot = self.allocate(Level.DEVICE)
        except CapacityError:
            self.blocks.allocators[Level.HOST].free(host_slot)
            raise
        host, device = self.levels[Level.HOST], self.levels[Level.DEVICE]
        host.put(host_slot, self.codecs[Level.HOST].encode(k, v))
        device.put(device_slot, self.codecs[Level.DEVICE].encode(k, v))
        index = self.blocks.append_block(seq_id, pinned=pinned)
        self.blocks.attach(seq_id, index, Level.HOST, host_slot)
        self.blocks.attach(seq_id, index, Level.DEVICE, device_slot)
        self.bytes_moved["new->L1"] += host.bytes_per_slot
        self.bytes_moved["new->L0"] += device.bytes_per_slot
        return index

    def wanted_levels(self, seq_id: int, index: int) -> frozenset[Level]:
        """The levels the policy wants block `index` of the sequence on: for a block shared with other sequences
        (a reused prefix), every level any of them wants it on."""
        block = self.blocks.tables[seq_id].blocks[index]
        wanted: frozenset[Level] = frozenset()
        for owner in block.owners:
            table = self.blocks.tables.get(owner) if isinstance(owner, int) else None
            if table is not None:
                wanted |= self.policy.levels_for(len(table.blocks) - 1 - index, block.pinned)
        return wanted

    def place(self, seq_id: int) -> None:
        """Move each block of the sequence to the levels the policy wants it on, by its age."""
        table = self.blocks.tables[seq_id]
        n = len(table.blocks)
        for i, block in enumerate(table.blocks):
            if block.pinned:
                continue
            wanted = self.wanted_levels(seq_id, i) if len(block.owners) > 1 else self.policy.levels_for(n - 1 - i, False)
            if Level.DEVICE in block.slots and Level.DEVICE not in wanted:
                self._demote_from_device(seq_id, i)
            if Level.DISK in wanted and Level.HOST not in wanted and block.primary == Level.HOST \
                    and Level.DISK in self.levels:
                self._demote_to_disk(seq_id, i)

    def restore(self, seq_id: int, num_blocks: int) -> None:
        """Bring the first `num_blocks` blocks (a reused prefix) up to the levels the policy wants them on: an FP16
        L1 copy decoded from L2 where only that is left, an L0 copy re-quantized from L1."""
        for i in range(num_blocks):
            self.restore_block(seq_id, i)

    def restore_block(self, seq_id: int, index: int) -> None:
        """Bring one block of a reused prefix up to the levels the policy wants it on (see `restore`)."""
        block = self.blocks.tables[seq_id].blocks[index]
        wanted = self.wanted_levels(seq_id, index)
        if Level.HOST in wanted and Level.HOST not in block.slots:
            self._restore_to_host(seq_id, index)
        if Level.DEVICE in wanted and Level.DEVICE not in block.slots:
            self.promote_to_device(seq_id, index)

    def release(self, seq_id: int, keep_cached: bool = True) -> None:
        """Free every slot the sequence holds, on every level; its named blocks stay in the prefix cache unless
        `keep_cached` is False (its KV is in doubt, e.g. after a corrupt cold block)."""
        for level, slot in self.blocks.free_sequence(seq_id, keep_cached):
            self.levels[level].free(slot)
        self._trim_cached()

    def _trim_cached(self) -> None:
        """Keep the copies of unused cached blocks within their budgets: beyond the L1 budget the least recently
        used go to L2, beyond the L2 budget they leave the cache (their slots are reused first, so the cold file
        stays near the working set plus that budget)."""
        cache = self.blocks.prefix_cache
        if cache is None:
            return
        for level, budget in ((Level.HOST, self.cached_host_slots), (Level.DISK, self.cached_disk_slots)):
            if budget is None or level not in self.levels:
                continue
            excess = cache.unused_copies()[level] - budget
            for _ in range(max(0, excess)):
                if not self._evict_cached(level):
                    break

    def demote_sequence(self, seq_id: int) -> int:
        """Drop every L0 copy of the sequence's blocks, pinned ones included (preemption under device pressure).

        Nothing is lost: every block keeps its FP16 copy in L1 (or its L2 copy). The still-filling block stays in
        its row. Returns the number of blocks demoted.
        """
        demoted = 0
        for index, block in enumerate(self.blocks.tables[seq_id].blocks):
            if Level.DEVICE in block.slots:
                assert len(block.slots) > 1, "an L0 copy is never a block's only copy"
                self._demote_from_device(seq_id, index)
                demoted += 1
        return demoted

    def promote_sequence(self, seq_id: int) -> int:
        """Undo demote_sequence: restore the L0 copies the policy keeps (sinks, pinned spans, the newest window),
        re-quantized from the FP16 copies, so attention reads exactly what it read before. Returns the count."""
        table = self.blocks.tables[seq_id]
        promoted = 0
        for index, block in enumerate(table.blocks):
            hot = Level.DEVICE in self.policy.levels_for(len(table.blocks) - 1 - index, block.pinned)
            if hot and Level.DEVICE not in block.slots:
                self.promote_to_device(seq_id, index)
                promoted += 1
        device = self.levels[Level.DEVICE]
        self.bytes_moved["L1->L0"] = self.bytes_moved.get("L1->L0", 0) + promoted * device.bytes_per_slot
        return promoted

    def _restore_to_host(self, seq_id: int, index: int) -> None:
        """An L1 copy of a block that is only on L2 (decoded from its INT2 copy: as precise as that copy)."""
        block = self.blocks.tables[seq_id].blocks[index]
        k, v = self.codecs[Level.DISK].decode(self.levels[Level.DISK].read_block(block.slots[Level.DISK]), KV_DTYPE)
        slot = self.allocate(Level.HOST)
        host = self.levels[Level.HOST]
        host.put(slot, self.codecs[Level.HOST].encode(k, v))
        self.blocks.attach(seq_id, index, Level.HOST, slot)
        self.bytes_moved["L2->L1"] = self.bytes_moved.get("L2->L1", 0) + host.bytes_per_slot

    def promote_to_device(self, seq_id: int, index: int) -> None:
        """Give block `index` an L0 copy, re-quantized from its FP16 copy when one exists (so promotion never
        compounds quantization error), else from its L2 copy."""
        block = self.blocks.tables[seq_id].blocks[index]
        source = Level.HOST if Level.HOST in block.slots else Level.DISK
        k, v = self.codecs[source].decode(self.levels[source].read_block(block.slots[source]), KV_DTYPE)
        slot = self.allocate(Level.DEVICE)
        self.levels[Level.DEVICE].put(slot, self.codecs[Level.DEVICE].encode(k, v))
        self.blocks.attach(seq_id, index, Level.DEVICE, slot)

    def allocate(self, level: Level) -> int:
        """A free slot on `level`: a free one, else one a cached block nobody uses gives up (least recently used
        first), else one a live block's demotion frees; CapacityError when nothing can move."""
        slot = self.blocks.allocate(level)
        while slot is None and self._evict_cached(level):
            slot = self.blocks.allocate(level)
        if slot is None:
            self._make_room(level)
            slot = self.blocks.allocate(level)
        if slot is None:
            raise CapacityError(self._full_message(level))
        return slot

    def _evict_cached(self, level: Level) -> bool:
        """Drop one unused cached block's copy on `level`; a warm block with no cold copy is written to L2 first (the
        prefix cache keeps it, on disk). False when no unused block has a copy there."""
        cache = self.blocks.prefix_cache
        block = cache.evictable(level) if cache is not None else None
        if block is None:
            return False
        if level == Level.HOST and Level.DISK in self.levels and Level.DISK not in block.slots:
            try:
                self.write_cold_copy(block)
            except FlashMemoryError:
                pass  # no room on disk (or a write error): the block leaves the cache
        for lv, slot in self.blocks.evict_cached(level):
            self.levels[lv].free(slot)
        if level == Level.HOST:
            self._lost_master(block)
        return True

    def write_cold_copy(self, block: BlockEntry) -> None:
        """Give a block with an L1 copy an L2 copy as well (re-encoded from FP16), named for later processes."""
        k, v = self.codecs[Level.HOST].decode(self.levels[Level.HOST].read_block(block.slots[Level.HOST]), KV_DTYPE)
        slot = self.allocate(Level.DISK)
        disk = self.levels[Level.DISK]
        try:
            disk.put(slot, self.codecs[Level.DISK].encode(k, v), block.block_hash or 0)
        except Exception:
            self.blocks.allocators[Level.DISK].free(slot)
            raise
        block.slots[Level.DISK] = slot
        self.bytes_moved["L1->L2"] += disk.bytes_per_slot

    def _detach(self, seq_id: int, index: int, level: Level) -> None:
        self.levels[level].free(self.blocks.detach(seq_id, index, level))

    def _demote_from_device(self, seq_id: int, index: int) -> None:
        # The FP16 master copy stays in L1: dropping the L0 copy loses nothing.
        self._detach(seq_id, index, Level.DEVICE)
        self.bytes_moved["L0->L1"] += self.levels[Level.DEVICE].bytes_per_slot

    def _demote_to_disk(self, seq_id: int, index: int) -> None:
        block = self.blocks.tables[seq_id].blocks[index]
        if Level.DISK in block.slots:  # restored from L2 earlier: its cold copy is still there
            self._detach(seq_id, index, Level.HOST)
            self._lost_master(block)
            return
        slot = self.allocate(Level.DISK)
        k, v = self.codecs[Level.HOST].decode(self.levels[Level.HOST].read_block(block.slots[Level.HOST]), KV_DTYPE)
        disk = self.levels[Level.DISK]
        try:
            disk.put(slot, self.codecs[Level.DISK].encode(k, v), block.block_hash or 0)
        except Exception:
            self.blocks.allocators[Level.DISK].free(slot)  # the block stays in L1, where it was
            raise
        self.blocks.attach(seq_id, index, Level.DISK, slot)
        self._detach(seq_id, index, Level.HOST)
        self._lost_master(block)
        self.bytes_moved["L1->L2"] += disk.bytes_per_slot

    def _lost_master(self, block: BlockEntry) -> None:
        """The block's L1 copy is gone: unless L2 keeps blocks as precisely (an FP16 cold zone), what is left is
        lossier than what a prefill writes, and the prefix cache must not offer it where a prefill keeps L1."""
        if Level.DISK in self.levels and self.codecs[Level.DISK].bits < self.codecs[Level.HOST].bits:
            block.master_lost = True

    def _make_room(self, level: Level) -> None:
        """Pressure: demote the oldest movable block of any sequence off `level`."""
        victim = None
        for seq_id, table in self.blocks.tables.items():
            n = len(table.blocks)
            for i, block in enumerate(table.blocks):
                movable = not block.pinned and (
                    (level == Level.DEVICE and Level.DEVICE in block.slots)
                    or (level == Level.HOST and block.primary == Level.HOST and Level.DISK in self.levels)
                )
                if movable:
                    age = n - 1 - i
                    if victim is None or age > victim[0]:
                        victim = (age, seq_id, i)
                    break  # blocks are in age order: the first movable one is this sequence's oldest
        if victim is None:
            return
        _, seq_id, i = victim
        if level == Level.DEVICE:
            self._demote_from_device(seq_id, i)
        else:
            self._demote_to_disk(seq_id, i)

    def _full_message(self, level: Level) -> str:
        if level == Level.DEVICE:
            return ("the device KV pool is full of pinned blocks and newest windows; raise max_gpu_memory_mb, "
                    "lower active_window, or run fewer sequences at once")
        if level == Level.HOST:
            hint = "" if Level.DISK in self.levels else " or set cold_zone_enabled=True"
            return f"the host KV pool is full (cpu_memory_gb); raise cpu_memory_gb{hint}"
        return "the cold zone file is full; raise cold_zone_gb or shorten the context"
