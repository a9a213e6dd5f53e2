"""Engine settings that hold FlashMemory's device KV to a given number of bytes.

FlashMemoryEngine takes one device budget, `max_gpu_memory_mb`, for weights + activation workspace + KV; the
benchmark speaks of the KV part alone (that is what the peers' caches are compared on). This module turns a KV
budget into `max_gpu_memory_mb` and the largest `active_window` whose L0 blocks fit, using the engine's own
start-up sizing (engine/sizing.py), so the L0 arena the engine allocates is never larger than the
KV budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from flashmemory.config import EngineConfig
from flashmemory.errors import ConfigError, MemoryBudgetError
from flashmemory.engine.sizing import DevicePlan, plan_device
from flashmemory.model.model_config import ModelConfig

MIB = 2**20


@dataclass
class BudgetedKnobs:
    """Settings for a KV budget, and what the engine will hold on the device under them."""

    knobs: dict[str, Any]  # engine keywords: max_gpu_memory_mb, active_window, plus the base knobs
    kv_budget_bytes: int
    device_kv_bytes: int  # the L0 arena (slots + rows of newest tokens) the engine allocates under these settings


def knobs_for_kv_budget(model_cfg: ModelConfig, dtype: str, kv_budget_bytes: int, base: dict[str, Any],
                        max_seq_len: int | None = None, weights_bytes: int | None = None) -> BudgetedKnobs:
    """The largest active_window (at most the engine default) whose L0 fits kv_budget_bytes, and the
    max_gpu_memory_mb that gives the engine exactly that much room for KV (rounded down to whole MiB)."""
    torch_dtype = getattr(torch, dtype)
    # The weights as the engine will hold them (a GGUF's block formats at their size), else dense in dtype.
    weights = weights_bytes or model_cfg.num_parameters() * torch.empty((), dtype=torch_dtype).element_size()
    first = EngineConfig(**{**base, "kv_cache": "tiered", "max_gpu_memory_mb": None})
    block_size = first.resolve_block_size(max_seq_len or model_cfg.max_context_tokens)
    # The rows of newest FP16 tokens first as configured, then (a budget too small for them) without.
    for cfg in (first, first.replace(recent_fp16_tokens=0)):
        probe = plan_device(cfg, model_cfg, weights, torch_dtype, block_size)
        room = kv_budget_bytes - probe.filling_bytes
        window = min(cfg.active_window, (room // probe.slot_bytes - 1) * block_size)
        while window >= block_size:
            trial = cfg.replace(active_window=window)
            unbudgeted = plan_device(trial, model_cfg, weights, torch_dtype, block_size)
            total = weights + unbudgeted.workspace_bytes + kv_budget_bytes
            budget_mb = int(total // MIB)
            try:
                plan: DevicePlan = plan_device(trial.replace(max_gpu_memory_mb=budget_mb), model_cfg, weights,
                                               torch_dtype, block_size)
            except MemoryBudgetError:  # rounding down to whole MiB cost a block: try a smaller window
                window -= block_size
                continue
            arena = plan.device_slots * plan.slot_bytes + plan.filling_bytes
            knobs = {**base, "kv_cache": "tiered", "max_gpu_memory_mb": budget_mb, "active_window": window,
                     "recent_fp16_tokens": cfg.recent_fp16_tokens}
            return BudgetedKnobs(knobs, kv_budget_bytes, arena)
    raise ConfigError(
        f"a device KV budget of {kv_budget_bytes / MIB:.3f} MiB cannot hold the attention-sink block, one "
        f"{block_size}-token window block ({probe.slot_bytes / MIB:.3f} MiB each) and the newest block "
        f"({probe.filling_bytes / MIB:.3f} MiB) once max_gpu_memory_mb is rounded down to whole MiB: "
        "raise --budget-mb or use longer --lengths"
    )
