"""Watchers on the read path for MATS-2: every byte the prefetch subsystem serves is checked against the shadow.

The cache reads L2 layers through a read-through source (the Prefetcher) and L1 per-head selections through a
per-head source (DeviceStaging); the reader lets any object with the same method stand there
(`BlockReader.use_read_through` / `use_per_head_source`), so a watcher wraps each, checks what it returns and
passes it on unchanged. A third watcher stands on the cold level's `read_segment` — the one call every cold read
goes through, the prefetch threads' included — to pair each injected bit flip with its outcome.
"""

from __future__ import annotations

import torch

from flashmemory.errors import ColdBlockError
from flashmemory.kvcache.levels.disk_pool import DiskPool
from flashmemory.kvcache.manager.blocks import Level
from flashmemory.kvcache.prefetch.device_staging import DeviceStaging
from flashmemory.kvcache.prefetch.prefetcher import Prefetcher
from flashmemory.kvcache.quant import Parts
from flashmemory.tools.mats.checker import ShadowChecker
from flashmemory.tools.mats.faults import FaultLedger


class CheckedReadThrough:
    """Serves L2 layer reads through the prefetcher and checks each segment against the shadow."""

    def __init__(self, prefetcher: Prefetcher, checker: ShadowChecker) -> None:
        self.prefetcher = prefetcher
        self.checker = checker
        self.num_reads = 0

    def read_layer(self, slots: list[int], layer: int, seq_id: int, decoding: bool) -> Parts:
        parts = self.prefetcher.read_layer(slots, layer, seq_id, decoding)  # [kv_heads, n, ...]
        self.checker.check_layer(Level.DISK, list(slots), parts, layer, "served by the prefetcher")
        self.num_reads += len(slots)
        return parts


class CheckedPerHeadSource:
    """Serves L1 per-head gathers through device staging and checks each KV head's record against the shadow."""

    def __init__(self, staging: DeviceStaging, checker: ShadowChecker) -> None:
        self.staging = staging
        self.checker = checker
        self.num_reads = 0

    def get_layer_per_head(self, slots: torch.Tensor, layer: int) -> Parts:
        parts = self.staging.get_layer_per_head(slots, layer)  # [kv_heads, n, ...]
        check_per_head(self.checker, slots, parts, layer, "served by device staging")
        self.num_reads += slots.numel()
        return parts


def check_per_head(checker: ShadowChecker, slots: torch.Tensor, parts: Parts, layer: int, what: str) -> int:
    """Check records [kv_heads, n, ...] of host slots [kv_heads, n] (each KV head its own); returns wrong ones."""
    owners = checker.owners(Level.HOST)
    wrong = 0
    for head, row in enumerate(slots.tolist()):
        for j, slot in enumerate(row):
            owner = owners.get(slot)
            if owner is None:
                checker.errors.add("stale read", f"{what}: L1 slot {slot} (KV head {head}) was served but no live "
                                                 "block holds it")
                wrong += 1
                continue
            record = {name: t[head, j] for name, t in parts.items()}
            wrong += not checker.check(Level.HOST, *owner, record, layer, what, head=head)
    return wrong


def watch_segment_reads(pool: DiskPool, ledger: FaultLedger) -> None:
    """Resolve each read's injected fault by what `read_segment` did with it: raised (detected) or returned
    (served). Installed on the pool object itself, so the prefetch threads' reads are watched too."""
    read_segment = pool.read_segment

    def watched(slot: int, layer: int, count_failures: bool = True) -> bytes:
        try:
            data = read_segment(slot, layer, count_failures)
        except ColdBlockError:
            ledger.resolve("read", detected=True)
            raise
        except BaseException:
            ledger.resolve("read", detected=False)
            raise
        ledger.resolve("read", detected=False)
        return data

    pool.read_segment = watched  # type: ignore[method-assign]
