"""The storage media a KV level can live on, by name: a new medium is one file plus one line here.

The levels themselves (their order, precision and capacity) are data: TieredCacheConfig.hierarchy()
lists them from the settings, and a medium named in the kv_levels setting is looked up here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from flashmemory.errors import ConfigError
from flashmemory.kvcache.config import TieredCacheConfig
from flashmemory.kvcache.levels.device_arena import DeviceArena
from flashmemory.kvcache.levels.disk_pool import DiskPool
from flashmemory.kvcache.levels.protocol import StorageLevel
from flashmemory.kvcache.levels.tensor_pool import TensorPool
from flashmemory.kvcache.manager.blocks import Level
from flashmemory.kvcache.manager.hierarchy import LevelSpec, as_level, level_label
from flashmemory.kvcache.quant import Codec

LevelFactory = Callable[[Level, Codec, int, TieredCacheConfig], StorageLevel]


def _device_memory(level: Level, codec: Codec, num_slots: int, cfg: TieredCacheConfig) -> StorageLevel:
    # Re-sizable in segments: the budget controller gives device memory back when it shrinks L0.
    return DeviceArena(level, codec, num_slots, cfg.num_layers, cfg.num_kv_heads, cfg.block_size, cfg.head_dim,
                      cfg.device)


def _host_memory(level: Level, codec: Codec, num_slots: int, cfg: TieredCacheConfig) -> StorageLevel:
    # Page-locked where CUDA is present, so copies to the device can run asynchronously (pinned
    # memory is locked already); mlocked on a CPU host with lock_host_memory.
    cuda = cfg.device.type == "cuda"
    return TensorPool(level, codec, num_slots, cfg.num_layers, cfg.num_kv_heads, cfg.block_size,
                      cfg.head_dim, torch.device("cpu"), pin_memory=cuda,
                      lock_memory=cfg.lock_host_memory and not cuda)


def _disk_file(level: Level, codec: Codec, num_slots: int, cfg: TieredCacheConfig) -> StorageLevel:
    pool = DiskPool(codec, num_slots, cfg.num_layers, cfg.num_kv_heads, cfg.block_size, cfg.head_dim,
                    cfg.cold_zone_dir, cfg.model_fingerprint, persistent=cfg.persist_cache,
                    namespace=cfg.prefix_namespace())
    pool.level = level
    pool.set_uncached_reads(cfg.cold_zone_uncached_reads)
    return pool


MEDIA: dict[str, LevelFactory] = {
    "device_memory": _device_memory,
    "host_memory": _host_memory,
    "disk_file": _disk_file,
}


def build_levels(cfg: TieredCacheConfig, specs: tuple[LevelSpec, ...],
                 codecs: dict[int, Codec]) -> dict[int, StorageLevel]:
    """One storage level per level of the hierarchy, by level; ConfigError for a medium not in
    MEDIA."""
    levels: dict[int, StorageLevel] = {}
    try:
        for i, spec in enumerate(specs):
            factory = MEDIA.get(spec.medium)
            if factory is None:
                raise ConfigError(f"{level_label(i)}'s medium {spec.medium!r} is not a known "
                                  f"storage medium; use one of {', '.join(sorted(MEDIA))} "
                                  "(kv_levels)")
            level = as_level(i)
            levels[level] = factory(level, codecs[level], spec.num_slots, cfg)
    except Exception:
        for built in levels.values():
            built.close()
        raise
    return levels
