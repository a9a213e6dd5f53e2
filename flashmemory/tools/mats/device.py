"""The device MATS-1 and MATS-2 run their caches on: the one the engine computes on when left to
choose, so the suites stress the L0 pool, the FP16 rows and device staging where they live in
service (CUDA when present), with the CPU as the fallback."""

from __future__ import annotations

import torch

from flashmemory.config import EngineConfig


def compute_device() -> torch.device:
    """The engine's device for device="auto": CUDA when this machine has it, else the CPU."""
    return EngineConfig(device="auto").resolve_device()
