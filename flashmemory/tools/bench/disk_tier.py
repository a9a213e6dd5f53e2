"""Engine settings that put a given fraction of a prompt's KV on the disk level (L2) at any context length.

FlashMemory keeps the newest `active_window` tokens in L0 and the next `warm_tokens` in L1; only older KV reaches
L2. The defaults (2048 + 16384) keep everything off the disk below 18K tokens, so the disk engines of the bench
(fm-mixed-disk and its prefetching twins) size both per length: the window and the warm span share the tokens
that stay resident, the window at most the engine's default, both whole blocks.
"""

from __future__ import annotations

from typing import Any

from flashmemory.config import EngineConfig
from flashmemory.errors import ConfigError


def knobs_for_disk_fraction(context_tokens: int, disk_fraction: float, base: dict[str, Any]) -> dict[str, Any]:
    """`base` plus the active_window and warm_tokens that leave about `disk_fraction` of `context_tokens` on L2
    (at 8192 tokens and 0.5: a 2048-token window, 2048 warm tokens, 4096 tokens on disk)."""
    if not 0 < disk_fraction < 1:
        raise ConfigError(f"disk_fraction={disk_fraction!r} must be in (0, 1)")
    defaults = EngineConfig()
    block = int(base.get("block_size", defaults.block_size))  # the bench's engines use a fixed block size
    resident_tokens = int(context_tokens * (1 - disk_fraction)) // block * block
    window = max(block, min(defaults.active_window, resident_tokens // 2 // block * block))
    warm = max(0, resident_tokens - window)
    return {**base, "active_window": window, "warm_tokens": warm}
