"""MATS-1 and MATS-2 build their caches on the engine's compute device: CUDA where the machine has
it, else the CPU (the choice is tested here; running on a GPU needs one)."""

from __future__ import annotations

import torch

from flashmemory.tools.mats import coherence, temporal
from flashmemory.tools.mats.device import compute_device
from flashmemory.tools.mats.temporal import GEOMETRY


def test_mats_caches_go_on_cuda_when_the_machine_has_it(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert compute_device() == torch.device("cuda")
    assert temporal.CONFIGS[0].cache_config(GEOMETRY, str(tmp_path)).device == torch.device("cuda")
    assert coherence.CONFIGS[0].cache_config(str(tmp_path)).device == torch.device("cuda")


def test_mats_caches_fall_back_to_the_cpu_without_cuda(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert compute_device() == torch.device("cpu")
    assert temporal.CONFIGS[0].cache_config(GEOMETRY, str(tmp_path)).device == torch.device("cpu")
    assert coherence.CONFIGS[0].cache_config(str(tmp_path)).device == torch.device("cpu")
    explicit = torch.device("cuda", 1)  # a caller's own device wins over the choice
    assert coherence.CONFIGS[0].cache_config(str(tmp_path), explicit).device == explicit
