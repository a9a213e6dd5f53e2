"""Deliberately broken storage levels: MATS must report them (errors, a non-zero exit), or it checks nothing."""

from __future__ import annotations

import dataclasses

import torch

from flashmemory.kvcache.levels.disk_pool import DiskPool
from flashmemory.kvcache.levels.tensor_pool import TensorPool
from flashmemory.kvcache.manager.blocks import Level

BIT_FLIPPING_HOST = "host_memory_bit_flipping"
UNCHECKED_DISK = "disk_file_unchecked"


class BitFlippingPool(TensorPool):
    """A memory level that flips one bit of every record it hands out (a bad DIMM, a stray write)."""

    def _parts(self, records: torch.Tensor):
        records = records.clone()
        records.view(-1, records.shape[-1])[:, 0] ^= 0x10
        return super()._parts(records)


class UncheckedDiskPool(DiskPool):
    """A disk level that never verifies its checksums: whatever the file (or a fault) gives back is served."""

    def read_segment(self, slot: int, layer: int, count_failures: bool = True) -> bytes:
        offset = slot * self.record_bytes + self.header_bytes + layer * self.segment_bytes
        data = self.io.pread(self._fd, self.segment_bytes, offset)
        return data.ljust(self.segment_bytes, b"\0")


def bit_flipping_host(level, codec, num_slots, cfg):
    return BitFlippingPool(level, codec, num_slots, cfg.num_layers, cfg.num_kv_heads, cfg.block_size, cfg.head_dim,
                           torch.device("cpu"))


def unchecked_disk(level, codec, num_slots, cfg):
    return UncheckedDiskPool(codec, num_slots, cfg.num_layers, cfg.num_kv_heads, cfg.block_size, cfg.head_dim,
                             cfg.cold_zone_dir, cfg.model_fingerprint)


def register(monkeypatch) -> None:
    """Make the broken media available by name for this test (levels/registry.py's MEDIA)."""
    from flashmemory.kvcache.levels import registry

    monkeypatch.setitem(registry.MEDIA, BIT_FLIPPING_HOST, bit_flipping_host)
    monkeypatch.setitem(registry.MEDIA, UNCHECKED_DISK, unchecked_disk)


def with_medium(configs, level: Level, medium: str):
    return tuple(dataclasses.replace(c, level_media=((level, medium),)) for c in configs)
