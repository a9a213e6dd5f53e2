"""The L2 prefetcher's figures over one measured request, from the cache's cumulative counters before and after.

The counters (`prefetch_*` keys of `cache.stats()`) run since the cache started, the worker's warm-up request
included, so the request's own figures are differences; the hit rate is hits over the L2 segment reads of the
request (0 when it read none, as the cache reports it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class PrefetchFigures:
    """What the prefetcher did during one request's decode steps (prefill reads pass through uncounted)."""

    hit_rate: float  # fraction of L2 segment reads served from the staging area (0-1)
    issued: int  # L2 segment reads queued ahead
    hits: int  # L2 segment reads served from the staging area
    misses: int  # L2 segment reads that went to the disk
    wasted_bytes: int  # prefetched and dropped unread
    predictor_ms_per_step: float  # the ranker's time per decode step (all layers)


def prefetch_figures(before: dict[str, Any], after: dict[str, Any], decode_steps: int) -> PrefetchFigures | None:
    """Figures between two `cache.stats()` snapshots; None when the cache runs no prefetcher."""
    if "prefetch_hits" not in after:
        return None

    def delta(key: str) -> int:
        return int(after.get(key, 0)) - int(before.get(key, 0))

    hits, misses = delta("prefetch_hits"), delta("prefetch_misses")
    seconds = float(after.get("prefetch_predictor_seconds", 0.0)) - float(before.get("prefetch_predictor_seconds", 0.0))
    predictor_ms = 1000 * seconds / decode_steps if decode_steps > 0 else 0.0
    return PrefetchFigures(hit_rate=hits / (hits + misses) if hits + misses else 0.0, issued=delta("prefetch_issued"),
                           hits=hits, misses=misses, wasted_bytes=delta("prefetch_wasted_bytes"),
                           predictor_ms_per_step=predictor_ms)
