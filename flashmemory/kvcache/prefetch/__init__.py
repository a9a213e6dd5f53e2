"""Prefetch, an optional subsystem: access statistics, the heat predictor, the L2 prefetcher and L1 device staging.

It sees the cache only as a choice observer (read/choice.py) and the levels only through their protocol
(levels/protocol.py); `build_prefetch` assembles it from the cache's configuration and levels, and the cache plugs
its parts into the read path as sources for L2 (read-through) and L1 (per-head device copies).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from flashmemory.kvcache.config import TieredCacheConfig
from flashmemory.kvcache.levels.protocol import StorageLevel
from flashmemory.kvcache.levels.tensor_pool import TensorPool
from flashmemory.kvcache.manager.blocks import Level
from flashmemory.kvcache.prefetch.device_staging import DeviceStaging
from flashmemory.kvcache.prefetch.heat_predictor import HeatPredictor
from flashmemory.kvcache.prefetch.prefetcher import Prefetcher

logger = logging.getLogger(__name__)


@dataclass
class PrefetchParts:
    """What build_prefetch made (either may be None)."""

    prefetcher: Prefetcher | None  # ranks blocks at each decode step's end; reads L2 ahead of need
    device_staging: DeviceStaging | None  # L1 blocks copied to the device ahead of need


def build_prefetch(cfg: TieredCacheConfig, levels: dict[Level, StorageLevel]) -> PrefetchParts:
    """The prefetch parts the configuration asks for, over these levels."""
    staging = None
    host = levels[Level.HOST]
    if cfg.device_staging_bytes > 0 and isinstance(host, TensorPool):
        if cfg.device.type == "cpu":
            logger.warning("device_staging_mb on a CPU host: L1 already is the compute's memory, "
                           "staging only adds copies (and the decode kernel reads L1 in place)")
        staging = DeviceStaging(host, cfg.device, cfg.device_staging_bytes)
    cold = levels.get(Level.DISK)
    prefetcher = None
    if cfg.prefetch_strategy != "none" and (cold is not None or staging is not None):
        predictor = HeatPredictor.load(cfg.heat_predictor_path) if cfg.prefetch_ranker == "predictor" else None
        prefetcher = Prefetcher(cold, cfg.num_layers, cfg.num_kv_heads, cfg.prefetch_strategy,
                                cfg.prefetch_budget_bytes, cfg.prefetch_ranker, predictor, device_staging=staging)
    return PrefetchParts(prefetcher, staging)
