"""The floor under MATS-2's prefetch race: however short a round, decode steps over cold blocks
until the Prefetcher's reader threads have read ahead a few segments while the workload rewrites
and evicts.

A round's random workload reaches L2 only after some hundred operations (a sequence must outgrow
the window and the warm span first), so a short run could end without one read by the prefetcher's
threads and pass without racing them. The steps here are ordinary forwards through the driver
(checked against the shadow, faults contained), only aimed: a running sequence with blocks in L2
decodes a token; when none has any, one is prefilled past the window and the warm span.
"""

from __future__ import annotations

from collections.abc import Callable

from flashmemory.kvcache.manager.blocks import Level
from flashmemory.tools.mats.driver import CacheDriver

MIN_PREFETCH_READS = 4  # segments the reader threads must have read (or lost to a race) per round
MAX_RACE_STEPS = 400  # forwards spent on it at most (never enough once the cold file is gone)
READS = ("prefetch_completed", "prefetch_dropped_races")  # a reader's read: served, or raced away


def prefetch_reads(counters: dict[str, int]) -> int:
    """Segments the reader threads read: completed, or dropped because a rewrite raced them."""
    return sum(int(counters.get(key, 0)) for key in READS)


def race_prefetcher(driver: CacheDriver, max_live: int, stop: Callable[[], bool]) -> int:
    """Drive decode steps until the cache's prefetcher has read MIN_PREFETCH_READS segments (or
    `stop()` says the round cannot go on); returns the forwards it ran."""
    prefetcher = driver.cache.prefetcher
    if prefetcher is None:
        return 0
    steps = 0
    while steps < MAX_RACE_STEPS and not stop() \
            and prefetch_reads(prefetcher.counters) < MIN_PREFETCH_READS:
        seq_id = _cold_sequence(driver)
        if seq_id is None:
            _add_cold_sequence(driver, max_live)
        else:
            driver.forward([(seq_id, 1)])
        steps += 1
    return steps


def _cold_sequence(driver: CacheDriver) -> int | None:
    """A running sequence with room for a token and a block in L2 (its decode steps choose among
    L2 blocks)."""
    for seq_id, seq in driver.live.items():
        if seq.parked or seq.full or seq.num_cached < seq.shadow.num_tokens:
            continue
        if any(Level.DISK in block.slots for block in driver.cache.blocks.tables[seq_id].blocks):
            return seq_id
    return None


def _add_cold_sequence(driver: CacheDriver, max_live: int) -> None:
    """Make room if need be, add a sequence and prefill it until blocks past the window and the
    warm span reach L2."""
    cfg = driver.cache.cfg
    if len(driver.live) >= max_live:
        driver.free(next(iter(driver.live)))
    seq_id = driver.add()
    seq = driver.live[seq_id]
    past_warm = cfg.active_window + cfg.warm_tokens + 4 * cfg.block_size
    target = min(seq.shadow.max_tokens // 2, past_warm)
    while seq_id in driver.live and seq.num_cached < target:
        before = seq.num_cached
        driver.forward([(seq_id, min(2 * cfg.block_size, target - seq.num_cached))])
        if seq.num_cached == before:
            break  # the forward failed (a fault, contained): the next loop picks or makes another
