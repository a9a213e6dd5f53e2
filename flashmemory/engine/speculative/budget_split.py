"""One memory budget for two models: the settings each model's KV cache is built from when a draft
model runs beside the target.

- Host and disk (cpu_memory_gb, cold_zone_gb, and the prefix cache's and prefetcher's shares, as
  set or as their defaults): split by the models' KV bytes per token, so both caches together stay
  within each figure.
- Device (max_gpu_memory_mb): the draft takes what its decode needs (its weights, activation
  workspace, rows of newest tokens and its hot window); the target sizes its L0 from the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flashmemory.config import EngineConfig
from flashmemory.engine.sizing import MIB, host_budget_gb, plan_device
from flashmemory.errors import MemoryBudgetError
from flashmemory.model.loader import Checkpoint, weights_bytes
from flashmemory.model.model_config import ModelConfig


@dataclass(frozen=True)
class BudgetSplit:
    """The target's and the draft's cache settings, and how the budgets were shared."""

    target: EngineConfig
    draft: EngineConfig
    draft_share: float  # of the host and disk budgets
    draft_device_mb: int | None  # of max_gpu_memory_mb (None: no device budget set)


def split_budgets(config: EngineConfig, target: ModelConfig, draft: Checkpoint, dtype: torch.dtype,
                  device: torch.device, max_seq_len: int) -> BudgetSplit:
    per_token_t, per_token_d = target.kv_bytes_per_token(2), draft.config.kv_bytes_per_token(2)
    share = per_token_d / (per_token_t + per_token_d)
    host = host_budget_gb(config)

    def scaled(f: float, device_mb: int | None) -> EngineConfig:
        return config.replace(
            cpu_memory_gb=host.cpu_memory_gb * f, cold_zone_gb=host.cold_zone_gb * f,
            prefix_cache_host_mb=config.prefix_cache_host_mb * f,
            prefix_cache_disk_mb=config.prefix_cache_disk_mb * f,
            prefetch_budget_mb=config.prefetch_budget_mb * f, max_gpu_memory_mb=device_mb)

    if config.max_gpu_memory_mb is None or config.kv_cache != "tiered":
        return BudgetSplit(scaled(1 - share, config.max_gpu_memory_mb),
                           scaled(share, config.max_gpu_memory_mb), share, None)
    # What the draft's decode needs on the device: its weights, workspace, rows and hot window.
    need = plan_device(config.replace(max_gpu_memory_mb=None, device_staging_mb=0.0), draft.config,
                       weights_bytes(draft, config.weights_dtype, dtype, device), dtype,
                       config.resolve_block_size(max_seq_len))
    draft_mb = math.ceil((need.weights_bytes + need.workspace_bytes + need.filling_bytes
                          + need.device_slots * need.slot_bytes) / MIB)
    target_mb = config.max_gpu_memory_mb - draft_mb
    if target_mb < 1:
        raise MemoryBudgetError(
            f"max_gpu_memory_mb={config.max_gpu_memory_mb} cannot hold the draft model "
            f"{draft.path.name} ({draft_mb} MiB: its weights, workspace and hot window) and the "
            "target besides: raise max_gpu_memory_mb, pick a smaller draft, or use "
            "speculative_method='ngram' (no second model)")
    return BudgetSplit(scaled(1 - share, target_mb), scaled(share, draft_mb), share, draft_mb)
