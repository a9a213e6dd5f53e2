"""Placement and pressure for the tiered cache: which level each block lives on, and making room when one is full.

Policy: blocks that leave the newest `active_window` tokens drop their L0 copy (the FP16 L1 master copy stays);
blocks that also leave the next `warm_tokens` are re-encoded from FP16 for L2 and leave L1. Pinned blocks
never move. A full level demotes the oldest movable block of any sequence; if none can move, CapacityError
says which setting to change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from flashmemory.errors import CapacityError
from flashmemory.kvcache.manager.blocks import BlockManager, Level
from flashmemory.kvcache.config import KV_DTYPE

if TYPE_CHECKING:
    from flashmemory.kvcache.levels.disk_pool import DiskPool
    from flashmemory.kvcache.levels.tensor_pool import TensorPool
    from flashmemory.kvcache.quant import Codec
    from flashmemory.kvcache.config import TieredCacheConfig


class PlacementMixin:
    """Moves blocks between levels for TieredKVCache (which owns the state named below)."""

    cfg: TieredCacheConfig
    blocks: BlockManager
    codecs: dict[Level, Codec]
    device_pool: TensorPool
    host_pool: TensorPool
    disk_pool: DiskPool | None
    bytes_moved: dict[str, int]

    def _place(self, seq_id: int) -> None:
        """Move blocks that left the window to L1 and blocks that left the warm span to L2."""
        cfg = self.cfg
        table = self.blocks.tables[seq_id]
        n = len(table.blocks)
        window_blocks = cfg.active_window // cfg.block_size
        warm_blocks = cfg.warm_tokens // cfg.block_size
        for i in range(n):
            block = table.blocks[i]
            if block.pinned:
                continue
            age = n - 1 - i  # 0 = newest full block
            if age >= window_blocks and Level.DEVICE in block.slots:
                self._demote_from_device(seq_id, i)
            if age >= window_blocks + warm_blocks and block.primary == Level.HOST and self.disk_pool is not None:
                self._demote_to_disk(seq_id, i)

    def demote_sequence(self, seq_id: int) -> int:
        """Drop every L0 copy of the sequence's blocks, pinned ones included (preemption under device pressure).

        Nothing is lost: every block keeps its FP16 copy in L1 (or its L2 copy). The still-filling block stays in
        its staging row. Returns the number of blocks demoted.
        """
        demoted = 0
        for index, block in enumerate(self.blocks.tables[seq_id].blocks):
            if Level.DEVICE in block.slots:
                assert len(block.slots) > 1, "an L0 copy is never a block's only copy"
                self._demote_from_device(seq_id, index)
                demoted += 1
        return demoted

    def promote_sequence(self, seq_id: int) -> int:
        """Undo demote_sequence: restore the L0 copies placement keeps (sinks, pinned spans, the newest window),
        re-quantized from the FP16 copies, so attention reads exactly what it read before. Returns the count."""
        table = self.blocks.tables[seq_id]
        window_blocks = self.cfg.active_window // self.cfg.block_size
        promoted = 0
        for index, block in enumerate(table.blocks):
            hot = block.pinned or len(table.blocks) - 1 - index < window_blocks
            if hot and Level.DEVICE not in block.slots:
                self._promote_to_device(seq_id, index)
                promoted += 1
        self.bytes_moved["L1->L0"] = self.bytes_moved.get("L1->L0", 0) + promoted * self.device_pool.bytes_per_slot
        return promoted

    def _demote_from_device(self, seq_id: int, index: int) -> None:
        # The FP16 master copy stays in L1: dropping the L0 copy loses nothing.
        self.blocks.detach(seq_id, index, Level.DEVICE)
        self.bytes_moved["L0->L1"] += self.device_pool.bytes_per_slot

    def _demote_to_disk(self, seq_id: int, index: int) -> None:
        assert self.disk_pool is not None
        block = self.blocks.tables[seq_id].blocks[index]
        slot = self._allocate(Level.DISK)
        k, v = self.codecs[Level.HOST].decode(self.host_pool.get_block(block.slots[Level.HOST]), KV_DTYPE)
        self.disk_pool.put(slot, self.codecs[Level.DISK].encode(k, v))
        self.blocks.attach(seq_id, index, Level.DISK, slot)
        self.blocks.detach(seq_id, index, Level.HOST)
        self.bytes_moved["L1->L2"] += self.disk_pool.bytes_per_slot

    def _promote_to_device(self, seq_id: int, index: int) -> None:
        # Re-quantize from the FP16 copy when one exists, so promotion never compounds quantization error.
        block = self.blocks.tables[seq_id].blocks[index]
        if Level.HOST in block.slots:
            k, v = self.codecs[Level.HOST].decode(self.host_pool.get_block(block.slots[Level.HOST]), KV_DTYPE)
        else:
            assert self.disk_pool is not None
            layers = [self.disk_pool.get_layer([block.slots[Level.DISK]], layer) for layer in range(self.cfg.num_layers)]
            parts = {name: torch.cat([p[name] for p in layers]) for name in layers[0]}
            k, v = self.codecs[Level.DISK].decode(parts, KV_DTYPE)
        slot = self._allocate(Level.DEVICE)
        self.device_pool.put(slot, self.codecs[Level.DEVICE].encode(k, v))
        self.blocks.attach(seq_id, index, Level.DEVICE, slot)

    def _allocate(self, level: Level) -> int:
        slot = self.blocks.allocate(level)
        if slot is None:
            self._make_room(level)
            slot = self.blocks.allocate(level)
        if slot is None:
            raise CapacityError(self._full_message(level))
        return slot

    def _make_room(self, level: Level) -> None:
        """Pressure: demote the oldest movable block of any sequence off `level`."""
        victim = None
        for seq_id, table in self.blocks.tables.items():
            n = len(table.blocks)
            for i, block in enumerate(table.blocks):
                movable = not block.pinned and (
                    (level == Level.DEVICE and Level.DEVICE in block.slots)
                    or (level == Level.HOST and block.primary == Level.HOST and self.disk_pool is not None)
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
            hint = "" if self.disk_pool is not None else " or set cold_zone_enabled=True"
            return f"the host KV pool is full (cpu_memory_gb); raise cpu_memory_gb{hint}"
        return "the cold zone file is full; raise cold_zone_gb or shorten the context"
