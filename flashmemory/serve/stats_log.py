"""StatsLogger: a periodic one-line summary of the server (throughput, requests, KV usage per level); quiet when idle."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from flashmemory.kvcache.kv_stats import KVStats

logger = logging.getLogger(__name__)


class StatsLogger:
    """Owns the token counts since the last line and decides when the next line is due."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s  # seconds between lines; 0 = never log
        self.clock = clock
        self._last_at = clock()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._preemptions = 0

    def record(self, prompt_tokens: int = 0, generation_tokens: int = 0, preemptions: int = 0) -> None:
        self._prompt_tokens += prompt_tokens
        self._generation_tokens += generation_tokens
        self._preemptions += preemptions

    def maybe_log(self, num_running: int, num_waiting: int, kv_stats: KVStats) -> str | None:
        """Log (and return) the line when the interval has passed and something happened or is pending."""
        now = self.clock()
        elapsed = now - self._last_at
        if self.interval_s <= 0 or elapsed < self.interval_s:
            return None
        idle = not (self._prompt_tokens or self._generation_tokens or num_running or num_waiting)
        line = None
        if not idle:
            usage = ", ".join(f"{level.label} {level.usage:.1%}" for level in kv_stats.levels
                              if level.bytes_capacity)
            line = (f"prompt throughput {self._prompt_tokens / elapsed:.1f} tokens/s, generation throughput "
                    f"{self._generation_tokens / elapsed:.1f} tokens/s | running {num_running}, waiting "
                    f"{num_waiting}, preempted {self._preemptions} | KV usage {usage or 'n/a'}")
            if kv_stats.prefix is not None:
                line += f" | prefix cache hit rate {kv_stats.prefix.prefix_cache_hit_rate:.1%}"
            logger.info(line)
        self._last_at = now
        self._prompt_tokens = self._generation_tokens = self._preemptions = 0
        return line
