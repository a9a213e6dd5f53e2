"""Preload: a conversation's cached blocks brought up the hierarchy before its next turn arrives
(seed 004 §4: warm and cold KV loaded "while the user is typing").

A reused prefix is restored when its request is admitted (placement.restore_block: an FP16 copy
decoded from the disk level where only that is left, an L0 copy where the policy keeps one), and
that restoring is most of the next turn's time to first token after a restart. Preloading does the
same restoring ahead of time: the prefix's cached blocks are attached to a placeholder sequence
that holds no rows and computes nothing, restored block by block (the oldest first, as reuse
reads them) until done or told to stop, then released to the prefix cache with their new copies,
which the next request finds in memory. Lookups are not counted as prefix-cache queries."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flashmemory.errors import CapacityError, ColdBlockError

TieredCache = Any  # a TieredKVCache (not imported: it imports this module)

PRELOAD_SEQ_ID = -1  # the placeholder's id: never a scheduler's (they count up from 0)


@dataclass
class PreloadResult:
    """What one preload did."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, in cached blocks (what the next request reuses)
    blocks: int = 0  # cached blocks of the prefix
    blocks_restored: int = 0  # of them, given a faster copy (L1 from the disk level, L0)
    bytes_copied: int = 0  # copies restored from below, as the cache counts moves (not L0 copies)
    seconds: float = 0.0
    # None (done), "request" (work arrived), "timeout", "bad_block", "full" (no room on a level)
    stopped: str | None = None

    @property
    def complete(self) -> bool:
        return self.stopped is None

    def as_dict(self) -> dict[str, int | float | str | bool | None]:
        return {"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "blocks": self.blocks, "blocks_restored": self.blocks_restored,
                "bytes_copied": self.bytes_copied, "seconds": round(self.seconds, 4),
                "complete": self.complete, "stopped": self.stopped}


def preload_prefix(cache: TieredCache, token_ids: list[int],
                   should_stop: Callable[[], str | None] = lambda: None) -> PreloadResult:
    """Restore the cached blocks of the longest cached prefix of `token_ids` to the levels a
    sequence reusing them would want them on; `should_stop` is asked before each block (a reason
    to stop, or None)."""
    started = time.perf_counter()
    result = PreloadResult(prompt_tokens=len(token_ids))
    prefix = cache.prefix_cache
    if prefix is None or not token_ids:
        return result
    found = prefix.match(token_ids, (len(token_ids) - 1) // cache.cfg.block_size, count=False,
                         needs_master=cache.policy.keeps_master)
    result.blocks = len(found)
    result.cached_tokens = len(found) * cache.cfg.block_size
    if not found:
        return result
    blocks, placement = cache.blocks, cache.placement
    moved_before = sum(placement.bytes_moved.values())
    blocks.add_sequence(PRELOAD_SEQ_ID)
    try:
        for entry in found:
            blocks.share(PRELOAD_SEQ_ID, entry)
        for i, entry in enumerate(found):
            result.stopped = should_stop()
            if result.stopped is not None:
                break
            copies = len(entry.slots)
            try:
                placement.restore_block(PRELOAD_SEQ_ID, i)
            except ColdBlockError as error:  # never served: it leaves the cache, the rest stay
                prefix.drop_bad(entry, error.reason)
                result.stopped = "bad_block"
                break
            except CapacityError:  # the levels are full of live sequences' blocks: stop here
                result.stopped = "full"
                break
            result.blocks_restored += len(entry.slots) > copies
    finally:
        placement.release(PRELOAD_SEQ_ID, keep_cached=True)
    result.bytes_copied = sum(placement.bytes_moved.values()) - moved_before
    result.seconds = time.perf_counter() - started
    return result
