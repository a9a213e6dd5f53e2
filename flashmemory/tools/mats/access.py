"""RoPE-like access orders: which of a sequence's blocks a read touches, in the patterns attention produces.

Attention over rotary-embedded keys keeps coming back to the same places: the newest tokens (recency), the first
tokens (attention sinks), periodic positions (a rotary frequency's stride), and now and then a random old block (a
retrieved fact). The stress suites read blocks in these orders so every level is hit the way a model hits it.
"""

from __future__ import annotations

import torch

PATTERNS = ("recent", "sink", "strided", "random_old")


def access_order(pattern: str, num_blocks: int, window_blocks: int, generator: torch.Generator) -> list[int]:
    """Block indices (of num_blocks full blocks) one read of `pattern` touches, in the order it touches them."""
    if num_blocks == 0:
        return []
    if pattern == "recent":  # the newest blocks, newest first
        return list(range(num_blocks - 1, max(-1, num_blocks - 1 - max(1, window_blocks)), -1))
    if pattern == "sink":  # the first block, then the newest: what a sink-plus-window attention reads
        return sorted({0, num_blocks - 1})
    if pattern == "strided":  # one rotary period: every `stride`-th block from a random phase
        stride = int(torch.randint(2, 5, (1,), generator=generator))
        phase = int(torch.randint(0, stride, (1,), generator=generator))
        return list(range(phase, num_blocks, stride)) or [num_blocks - 1]
    if pattern == "random_old":  # a few blocks older than the window, in random order
        old = max(1, num_blocks - window_blocks)
        count = min(old, 4)
        return torch.randperm(old, generator=generator)[:count].tolist()
    raise ValueError(f"unknown access pattern {pattern!r}; use one of {', '.join(PATTERNS)}")
