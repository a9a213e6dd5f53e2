"""Start-up sizing of the KV levels: the device budget check (vLLM-style message), the host checks (L1 against the
RAM, L2 against the disk) and slot counts per level."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from flashmemory.config import EngineConfig
from flashmemory.kvcache.levels.cold_files import default_root
from flashmemory.errors import ConfigError, HostBudgetError, MemoryBudgetError
from flashmemory.kvcache.manager.blocks import Level
from flashmemory.kvcache.config import TieredCacheConfig, level_codecs
from flashmemory.kvcache.recent_rows import row_layout
from flashmemory.model.model_config import ModelConfig

logger = logging.getLogger(__name__)

MIB = 2**20
GIB = 2**30
MEMINFO = Path("/proc/meminfo")


@dataclass
class DevicePlan:
    """How the device budget splits (bytes)."""

    weights_bytes: int
    workspace_bytes: int
    filling_bytes: int  # the newest tokens of max_num_seqs sequences, unquantized (filling block + recent FP16)
    slot_bytes: int  # one L0 block of every layer
    device_slots: int
    device_staging_bytes: int = 0  # L1 blocks copied ahead of need (device_staging_mb)


def workspace_bytes(cfg: ModelConfig, chunk_tokens: int, attended_tokens: int, elem: int) -> int:
    """Peak activation bytes of one prefill chunk: hidden states, fused projections, MLP, attention scores, logits.

    An estimate from shapes (on CUDA a measured peak would replace it); errs high rather than low.
    """
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    per_token = (4 * cfg.hidden_size + qkv + 3 * cfg.intermediate_size) * elem
    scores = cfg.num_heads * chunk_tokens * (attended_tokens + chunk_tokens) * 4 * 2  # fp32 scores + probabilities
    logits = cfg.vocab_size * 4 * 2
    return chunk_tokens * per_token + scores + logits


def plan_device(engine_cfg: EngineConfig, model_cfg: ModelConfig, weights_bytes: int, dtype: torch.dtype,
                block_size: int) -> DevicePlan:
    elem = torch.empty((), dtype=dtype).element_size()
    codec = level_codecs(engine_cfg.kv_precision, block_size, model_cfg.head_dim)[Level.DEVICE]
    slot_bytes = codec.nbytes((model_cfg.num_layers, model_cfg.num_kv_heads), block_size, model_cfg.head_dim)
    recent, sink = row_layout(engine_cfg.recent_fp16_tokens, block_size, engine_cfg.active_window,
                              TieredCacheConfig.num_sink_blocks, codec.bits)
    row_tokens = sink + recent + block_size
    filling_one = 2 * model_cfg.num_layers * model_cfg.num_kv_heads * row_tokens * model_cfg.head_dim * 2
    filling = engine_cfg.max_num_seqs * filling_one
    window_slots = engine_cfg.active_window // block_size + 1  # + the attention-sink block
    attended = engine_cfg.active_window + engine_cfg.warm_budget_tokens + block_size
    workspace = workspace_bytes(model_cfg, engine_cfg.prefill_chunk_tokens, attended, elem)
    device_staging = engine_cfg.device_staging_bytes
    if engine_cfg.max_gpu_memory_mb is None:  # + the old blocks placement by locality may raise
        locality = engine_cfg.locality_device_blocks(block_size)
        return DevicePlan(weights_bytes, workspace, filling, slot_bytes,
                          engine_cfg.max_num_seqs * (window_slots + locality), device_staging)
    budget = engine_cfg.max_gpu_memory_mb * MIB
    free_for_kv = budget - weights_bytes - workspace - filling - device_staging
    slots = free_for_kv // slot_bytes if free_for_kv > 0 else 0
    if slots < window_slots:
        needed = weights_bytes + workspace + filling + device_staging + window_slots * slot_bytes
        fp16_per_token = model_cfg.kv_bytes_per_token(2)
        exact_fit = max(0, (budget - weights_bytes - workspace) // fp16_per_token)
        max_window = max(0, (slots - 1) * block_size) if slots > 1 else 0
        raise MemoryBudgetError(
            f"max_gpu_memory_mb={engine_cfg.max_gpu_memory_mb} is too small: the weights need "
            f"{weights_bytes / MIB:.0f} MiB, the activation workspace for prefill_chunk_tokens="
            f"{engine_cfg.prefill_chunk_tokens} about {workspace / MIB:.0f} MiB, the newest tokens (the filling "
            f"block and recent_fp16_tokens={engine_cfg.recent_fp16_tokens}) of max_num_seqs="
            f"{engine_cfg.max_num_seqs} sequences {filling / MIB:.1f} MiB, the device staging area "
            f"(device_staging_mb) {device_staging / MIB:.1f} MiB and the hot KV window "
            f"(active_window={engine_cfg.active_window}, kv_precision={engine_cfg.kv_precision}) "
            f"{window_slots * slot_bytes / MIB:.1f} MiB: {needed / MIB:.0f} MiB in all. "
            f"The largest active_window that fits is {max_window} tokens (an exact FP16 cache would fit "
            f"{exact_fit} tokens of context). Raise max_gpu_memory_mb to at least {-(-needed // MIB)}, or lower "
            "active_window, prefill_chunk_tokens, recent_fp16_tokens, max_num_seqs or device_staging_mb."
        )
    return DevicePlan(weights_bytes, workspace, filling, slot_bytes, int(slots), device_staging)


def tiered_config(engine_cfg: EngineConfig, model_cfg: ModelConfig, plan: DevicePlan, block_size: int,
                  device: torch.device, fingerprint_source: str) -> TieredCacheConfig:
    """Slot counts for every level from the budgets."""
    geometry = ((model_cfg.num_layers, model_cfg.num_kv_heads), block_size, model_cfg.head_dim)
    codecs = level_codecs(engine_cfg.kv_precision, block_size, model_cfg.head_dim)
    host_slot = codecs[Level.HOST].nbytes(*geometry)
    disk_slot = codecs[Level.DISK].nbytes(*geometry)
    # NOTE: every KV setting passes as the user set it; only block_size is resolved ("auto").
    return TieredCacheConfig(
        **{**engine_cfg.kv_settings(), "block_size": block_size},
        num_layers=model_cfg.num_layers,
        num_kv_heads=model_cfg.num_kv_heads,
        head_dim=model_cfg.head_dim,
        device_slots=plan.device_slots,
        host_slots=max(1, int(host_budget_gb(engine_cfg).cpu_memory_gb * GIB) // host_slot),
        disk_slots=max(1, int(host_budget_gb(engine_cfg).cold_zone_gb * GIB) // disk_slot),
        model_fingerprint=hashlib.sha256(fingerprint_source.encode()).digest()[:16],
        device=device,
        vocab_size=model_cfg.vocab_size,
    )


@dataclass(frozen=True)
class HostFigure:
    """A number of bytes the machine has, and where it was read (named in error messages)."""

    num_bytes: int
    source: str  # completes "the machine has N GiB ...": "available (MemAvailable in /proc/meminfo)"


def available_ram() -> HostFigure | None:
    """RAM that can still be allocated without swapping; None where it cannot be read."""
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):  # "MemAvailable:   18235716 kB" (Linux 3.14 and later)
                return HostFigure(int(line.split()[1]) * 1024, f"available (MemAvailable in {MEMINFO})")
    except (OSError, ValueError, IndexError):
        pass
    # NOTE: the fallback is the installed RAM, not the free pages (SC_AVPHYS_PAGES): free pages leave out the
    # page cache the kernel would give back, so comparing with them would refuse settings that work.
    try:
        return HostFigure(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "installed (sysconf: no MemAvailable to read)")
    except (AttributeError, ValueError, OSError):
        return None


def free_disk(folder: str) -> HostFigure | None:
    """Free bytes on the file system that holds `folder` (or will: its nearest existing parent); None if unknown."""
    path = Path(folder).expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return HostFigure(shutil.disk_usage(path).free, f"free on the disk of {path}")
    except OSError:
        return None


DEFAULT_CPU_MEMORY_GB = 4.0  # the L1 host pool when cpu_memory_gb is not set (capped at half the available RAM)
DEFAULT_COLD_ZONE_GB = 16.0  # the L2 file's limit when cold_zone_gb is not set (capped at half the free disk)


@dataclass(frozen=True)
class HostBudget:
    """The L1 and L2 capacities in effect (GiB): the settings, or their defaults fitted to the machine."""

    cpu_memory_gb: float
    cold_zone_gb: float


def host_budget_gb(cfg: EngineConfig) -> HostBudget:
    """cpu_memory_gb and cold_zone_gb as set; where unset, the defaults capped at half of what the machine has
    free, so a default run fits a small machine (explicit values are checked by check_host_budget instead)."""
    cpu = cfg.cpu_memory_gb
    if cpu is None:
        ram = available_ram()
        cpu = DEFAULT_CPU_MEMORY_GB if ram is None else max(min(DEFAULT_CPU_MEMORY_GB, ram.num_bytes / GIB / 2), 0.01)
    cold = cfg.cold_zone_gb
    if cold is None:
        disk = free_disk(cold_zone_folder(cfg)) if cfg.cold_zone_enabled else None
        cold = DEFAULT_COLD_ZONE_GB if disk is None else max(min(DEFAULT_COLD_ZONE_GB, disk.num_bytes / GIB / 2), 0.01)
    return HostBudget(cpu, cold)


def cold_zone_folder(cfg: EngineConfig) -> str:
    """Where the L2 file goes: cold_zone_dir, or by default a private folder under the FlashMemory cache folder."""
    return cfg.cold_zone_dir or str(default_root())


def check_persistence(cfg: EngineConfig) -> None:
    """persist_cache needs somewhere to persist to: a cold_zone_dir, the cold zone and the prefix cache."""
    if cfg.persist_cache and not (cfg.cold_zone_dir and cfg.cold_zone_enabled and cfg.prefix_caching):
        raise ConfigError("persist_cache needs a cold_zone_dir (the folder that outlives the process, e.g. "
                          "--cold-zone-dir ~/.cache/flashmemory/kv), the cold zone enabled and prefix_caching on")


def check_host_budget(cfg: EngineConfig) -> None:
    """Refuse, before any weight is loaded, an L1 host pool larger than the free RAM or an L2 file larger than the
    free disk of its folder (HostBudgetError names both numbers and the setting); skip what cannot be read and
    what was not set (the defaults fit themselves to the machine: host_budget_gb). Checks persist_cache too."""
    check_persistence(cfg)
    # NOTE: against MemAvailable, not MemTotal. The host pool is allocated lazily (torch.empty: the kernel commits
    # its pages as blocks are written; pinned memory on a CUDA host is committed at once), so a pool larger than
    # the free RAM starts fine and is killed by the OOM killer, or stops with a raw allocator error, once the KV
    # grows into it. MemTotal would only catch pools that cannot be allocated at all.
    ram = available_ram()
    if cfg.cpu_memory_gb is not None and ram is not None and cfg.cpu_memory_gb * GIB > ram.num_bytes:
        raise HostBudgetError(
            f"cpu_memory_gb={cfg.cpu_memory_gb:g} asks for a {cfg.cpu_memory_gb:g} GiB L1 host pool, but this machine "
            f"has {ram.num_bytes / GIB:.1f} GiB of RAM {ram.source}; lower cpu_memory_gb below "
            f"{ram.num_bytes / GIB:.1f} (the weights and activations need RAM too), or free memory")
    if not cfg.cold_zone_enabled:
        return
    disk = free_disk(cold_zone_folder(cfg))
    # NOTE: the L2 file is sparse, so this is what it may grow to, not what start-up writes.
    if cfg.cold_zone_gb is not None and disk is not None and cfg.cold_zone_gb * GIB > disk.num_bytes:
        raise HostBudgetError(
            f"cold_zone_gb={cfg.cold_zone_gb:g} lets the L2 file grow to {cfg.cold_zone_gb:g} GiB, but only "
            f"{disk.num_bytes / GIB:.1f} GiB are {disk.source}; lower cold_zone_gb to at most "
            f"{disk.num_bytes / GIB:.1f}, choose another cold_zone_dir, or turn the cold zone off (cold_zone_enabled=False, --no-cold-zone)")
    budget = host_budget_gb(cfg)
    logger.debug("host budget: L1 %.1f GiB of %s; L2 %.1f GiB of %s", budget.cpu_memory_gb,
                 ram.source if ram else "RAM unknown", budget.cold_zone_gb, disk.source if disk else "an unknown disk")
