"""One torch thread while MATS-1/2 run: their tensors are a few KiB, so a second intra-op thread only adds
synchronisation (and on a busy host, waiting for a core), never speed."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def torch_threads(num_threads: int) -> Iterator[None]:
    """Run the block with `num_threads` torch intra-op threads; the previous number is restored after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
