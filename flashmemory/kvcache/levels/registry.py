"""The storage media a KV level can live on, by name: a new medium is one file plus one line here."""

from __future__ import annotations

from collections.abc import Callable

import torch

from flashmemory.kvcache.config import TieredCacheConfig
from flashmemory.kvcache.levels.device_arena import DeviceArena
from flashmemory.kvcache.levels.disk_pool import DiskPool
from flashmemory.kvcache.levels.protocol import StorageLevel
from flashmemory.kvcache.levels.tensor_pool import TensorPool
from flashmemory.kvcache.manager.blocks import Level
from flashmemory.kvcache.quant import Codec

LevelFactory = Callable[[Level, Codec, int, TieredCacheConfig], StorageLevel]


def _device_memory(level: Level, codec: Codec, num_slots: int, cfg: TieredCacheConfig) -> StorageLevel:
    # Re-sizable in segments: the budget controller gives device memory back when it shrinks L0.
    return DeviceArena(level, codec, num_slots, cfg.num_layers, cfg.num_kv_heads, cfg.block_size, cfg.head_dim,
                      cfg.device)


def _host_memory(level: Level, codec: Codec, num_slots: int, cfg: TieredCacheConfig) -> StorageLevel:
    # Page-locked where CUDA is present, so copies to the device can run asynchronously.
    return TensorPool(level, codec, num_slots, cfg.num_layers, cfg.num_kv_heads, cfg.block_size, cfg.head_dim,
                      torch.device("cpu"), pin_memory=cfg.device.type == "cuda")


def _disk_file(level: Level, codec: Codec, num_slots: int, cfg: TieredCacheConfig) -> StorageLevel:
    pool = DiskPool(codec, num_slots, cfg.num_layers, cfg.num_kv_heads, cfg.block_size, cfg.head_dim,
                    cfg.cold_zone_dir, cfg.model_fingerprint, persistent=cfg.persist_cache,
                    namespace=cfg.prefix_namespace())
    pool.set_uncached_reads(cfg.cold_zone_uncached_reads)
    return pool


MEDIA: dict[str, LevelFactory] = {
    "device_memory": _device_memory,
    "host_memory": _host_memory,
    "disk_file": _disk_file,
}
DEFAULT_MEDIA = {Level.DEVICE: "device_memory", Level.HOST: "host_memory", Level.DISK: "disk_file"}


def build_levels(cfg: TieredCacheConfig, codecs: dict[Level, Codec]) -> dict[Level, StorageLevel]:
    """One storage level per KV level the configuration has (L2 only with a cold zone)."""
    slots = {Level.DEVICE: cfg.device_slots, Level.HOST: cfg.host_slots}
    if cfg.cold_zone_enabled:
        slots[Level.DISK] = cfg.disk_slots
    levels: dict[Level, StorageLevel] = {}
    try:
        for level, num_slots in slots.items():
            medium = cfg.level_media.get(level, DEFAULT_MEDIA[level])
            levels[level] = MEDIA[medium](level, codecs[level], num_slots, cfg)
    except Exception:
        for built in levels.values():
            built.close()
        raise
    return levels
