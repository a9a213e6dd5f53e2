"""tiered_stats: a TieredKVCache's KVStats snapshot, read from the parts it composes (levels,
allocators, placement, reader, prefix cache, sessions, prefetch)."""

from __future__ import annotations

from typing import Any

from flashmemory.kvcache.kv_stats import (KVStats, LevelStats, LocalityStats, MediumCounters, Move,
                                          PersistStats, PrefetchStats, StagingStats, prefix_stats)
from flashmemory.kvcache.manager.blocks import Level

TieredCache = Any  # a TieredKVCache (not imported: it imports this module)


def tiered_stats(cache: TieredCache) -> KVStats:
    """Every level in order, selection, moves and the parts the cache runs."""
    seqs = cache.seqs.values()
    moved = cache.placement.bytes_moved.items()
    # As vLLM counts them: cached blocks nobody uses are free (evicted on demand), reported apart.
    cached = {level: cache.placement.cached_copies(level) for level in cache.levels}
    stats = KVStats(len(cache.seqs), sum(s.num_tokens for s in seqs),
                    levels=[_level_stats(cache, level, cached) for level in cache.levels],
                    selection=cache.reader.selection_stats(s.digest for s in seqs),
                    moves=[Move(source, dest, n) for (source, dest), n in moved])
    if cache.prefix_cache is not None:
        stats.prefix = prefix_stats(cache.prefix_cache)
    if cache.sessions is not None and cache.sessions.store is not None:
        stats.persist = PersistStats(**cache.sessions.stats())  # what recovery discarded
    if cache.prefetcher is not None:
        stats.prefetch = PrefetchStats(**cache.prefetcher.stats())
    if cache.device_staging is not None:
        stats.staging = StagingStats(**cache.device_staging.stats())
    if cache.locality is not None:
        stats.locality = LocalityStats(**cache.locality.stats())
    if cache.shared is not None:
        stats.remote = cache.shared.stats()
    return stats


def _level_stats(cache: TieredCache, level: int, unused_copies: dict[int, int]) -> LevelStats:
    cached = unused_copies.get(level, 0)
    pool, allocator = cache.levels[level], cache.blocks.allocators[level]
    in_use = allocator.num_used - cached
    hot = level == Level.DEVICE  # its bytes count the newest tokens' rows and staging too
    out = LevelStats(level, cache.hierarchy[level].name, in_use, allocator.num_slots,
                     cache.device_bytes_used() if hot else in_use * pool.bytes_per_slot,
                     cache.device_bytes_capacity() if hot else pool.capacity_bytes,
                     cached, cached * pool.bytes_per_slot, MediumCounters.of(pool.counters()))
    chosen = cache.reader.level_selection(level)
    if chosen is not None:
        out.candidate_blocks, out.selected_fraction = chosen
    if cache.prefix_cache is not None:
        out.prefix_hit_blocks = cache.prefix_cache.hit_blocks[level]
        out.prefix_evicted_blocks = cache.prefix_cache.evicted_blocks[level]
    return out
