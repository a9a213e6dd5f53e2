"""Build the engine's KV cache from its settings: the start-up checks, the device plan and the cache itself
(contiguous or tiered), and the budget controller over the tiered cache's L0 pool."""

from __future__ import annotations

from collections.abc import Callable

import torch

from flashmemory.config import EngineConfig
from flashmemory.engine.budget_controller import BudgetController, BudgetRules, nvml_utilization
from flashmemory.engine.sizing import DevicePlan, check_host_budget, plan_device, tiered_config
from flashmemory.errors import ConfigError
from flashmemory.kvcache.contiguous import ContiguousKVCache
from flashmemory.kvcache.device_budget import DeviceBudget
from flashmemory.kvcache.interface import KVCache
from flashmemory.kvcache.tiered import TieredKVCache
from flashmemory.model.content_digest import model_content_digest
from flashmemory.model.model_config import ModelConfig


def kv_fingerprint_source(model_path: object, model_config: ModelConfig, dtype: torch.dtype,
                          weights_dtype: str) -> str:
    """What a model's KV depends on besides the tokens: the model's bytes (not its path: replicas
    that load one file from different places share its blocks), its config, the activation dtype
    and how the weights are kept (the same prompt's KV under other weights or dtype must not be
    reused)."""
    digest = model_content_digest(model_path)
    return f"sha256={digest}:{model_config}:{dtype}:weights={weights_dtype}"


def check_budgets(config: EngineConfig) -> None:
    """L1 against the free RAM, L2 against the free disk (the tiered cache only: the contiguous one uses neither)."""
    if config.kv_cache == "tiered":
        check_host_budget(config)


def device_plan_for(config: EngineConfig, model_config: ModelConfig, max_seq_len: int, dtype: torch.dtype,
                    weights_bytes: int) -> DevicePlan | None:
    """Split the device budget (weights as stored, workspace, L0 KV); None for the contiguous cache."""
    if config.kv_cache != "tiered":
        return None
    return plan_device(config, model_config, weights_bytes, dtype, config.resolve_block_size(max_seq_len))


def build_kv_cache(config: EngineConfig, model_config: ModelConfig, plan: DevicePlan | None, max_seq_len: int,
                   device: torch.device, dtype: torch.dtype, fingerprint: str) -> KVCache:
    """The cache `config` asks for; `fingerprint` names the model in the prefix cache's namespace."""
    mc = model_config
    if config.kv_cache == "contiguous":
        # The exact baseline: model dtype, or FP16 storage when kv_precision="fp16" is asked for.
        kv_dtype = torch.float16 if config.kv_precision == "fp16" else dtype
        return ContiguousKVCache(mc.num_layers, mc.num_kv_heads, mc.head_dim, kv_dtype, device,
                                 max_seq_len, mc.sliding_window_tokens, config.max_num_seqs)
    if mc.sliding_window_tokens is not None and mc.sliding_window_tokens < max_seq_len:
        raise ConfigError(
            f"this model uses sliding-window attention ({mc.sliding_window_tokens} tokens), which the tiered "
            "KV cache does not implement yet; use kv_cache='contiguous'"
        )
    assert plan is not None, "the tiered cache needs a device plan"
    block_size = config.resolve_block_size(max_seq_len)
    return TieredKVCache(tiered_config(config, mc, plan, block_size, device, fingerprint))


def build_budget_controller(config: EngineConfig, cache: KVCache, device: torch.device,
                            on_resize: Callable[[], None]) -> BudgetController | None:
    """The DynamicBudgetController over the cache's L0 pool when budget_controller=True."""
    if not config.budget_controller:
        return None
    if not isinstance(cache, TieredKVCache):
        raise ConfigError("budget_controller=True moves the tiered cache's L0 budget: use kv_cache='tiered' or "
                          "budget_controller=False")
    utilization = nvml_utilization(device.index or 0) if device.type == "cuda" else None
    source = "NVML GPU utilization" if utilization is not None else "engine thread busy fraction"
    rules = BudgetRules(min_fraction=config.budget_controller_min_fraction)
    return BudgetController(DeviceBudget(cache), rules, utilization=utilization, on_resize=on_resize,
                            source_name=source)
