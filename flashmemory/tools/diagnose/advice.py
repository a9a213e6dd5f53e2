"""From a DiagnoseReport to warnings and advice: each piece of advice is a concrete change of settings, the finding
behind it, the reason, the expected effect, and the named figure (DiagnoseReport.figures) it should improve."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from flashmemory.config import EngineConfig
from flashmemory.config_args import option_strings
from flashmemory.engine.sizing import GIB, MIB, available_ram, host_budget_gb, plan_device
from flashmemory.kvcache.manager.blocks import Level
from flashmemory.settings import setting_of
from flashmemory.tools.diagnose.report import DiagnoseReport

L2_STALL_SHARE = 0.10  # L2 reads taking this share of a decode step are worth removing
L0_OVERSIZED_USE = 0.5  # an L0 pool whose peak use stays below this share is oversized for the workload
MIN_COLD_ZONE_IOPS = 50_000  # seed 000 §3.3


@dataclass(frozen=True)
class Advice:
    """One concrete change: `change` is the settings to set, `figure` the DiagnoseReport figure it improves."""

    finding: str  # what was measured: "L2 reads stall 38 % of decode time"
    change: dict[str, Any]
    reason: str
    expected: str  # the expected effect, in the figure's terms
    figure: str
    seed_action: int | None = None  # seed 004 §6's action it corresponds to

    @property
    def flags(self) -> str:
        """The change as command-line flags (a switch back to its default is a flag to leave out)."""
        parts = []
        for name, value in self.change.items():
            flag = option_strings(EngineConfig, name)[0]
            if not isinstance(value, bool):
                parts.append(f"{flag} {value}")
            elif setting_of(EngineConfig, name).negatable:
                parts.append(flag if value else f"--no-{flag[2:]}")
            elif flag.startswith("--no-") != value:  # the switch's flag sets exactly this value
                parts.append(flag)
            else:
                parts.append(f"(leave out {flag})")
        return " ".join(parts)

    @property
    def headline(self) -> str:
        settings = ", ".join(f"{k}={v!r}" for k, v in self.change.items())
        return f"{self.finding}: set {settings}"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "flags": self.flags, "headline": self.headline}


@dataclass
class Context:
    """What the rules read: the report, the engine's settings and what it sized at start-up."""

    report: DiagnoseReport
    engine: Any

    @property
    def cfg(self) -> EngineConfig:
        return self.engine.config

    @property
    def f(self) -> dict[str, float]:
        return self.report.figures


Rule = Callable[[Context], Advice | str | None]


def _l2_stall(c: Context) -> Advice | None:
    share = c.f.get("decode_l2_read_share", 0.0)
    if share < L2_STALL_SHARE or c.cfg.prefetch_strategy != "none":
        return None
    return Advice(f"L2 reads stall {share:.0%} of decode time ({c.f['decode_l2_read_ms']:.1f} of "
                  f"{c.f['decode_ms_per_step']:.1f} ms per step)", {"prefetch_strategy": "adaptive"},
                  "decode steps wait for the disk; the prefetcher reads the blocks the next step will select "
                  "in background threads and serves them from host memory",
                  "decode_l2_read_share falls (held-out 8K runs: L2 hit rate 0.98, decode 1.6-1.8x faster, "
                  "docs/prefetch.md)", "decode_l2_read_share", 11)


def _l2_stall_with_prefetch(c: Context) -> Advice | None:
    share = c.f.get("decode_l2_read_share", 0.0)
    hit = c.report.prefetch.get("prefetch_hit_rate")
    if share < L2_STALL_SHARE or c.cfg.prefetch_strategy == "none" or hit is None or hit >= 0.9:
        return None
    budget = c.cfg.prefetch_budget_mb * 2
    return Advice(f"L2 reads still take {share:.0%} of decode time with prefetch (hit rate {hit:.0%})",
                  {"prefetch_strategy": "aggressive", "prefetch_budget_mb": budget},
                  "the staging area or the depth is too small for what the steps select",
                  "decode_l2_read_share falls as the hit rate rises", "decode_l2_read_share", 11)


def _warm_fits_in_ram(c: Context) -> Advice | None:
    l2_mib = c.f.get("l2_used_mib", 0.0)
    tokens = int(c.f.get("sequence_tokens", 0))
    if l2_mib <= 0 or not tokens:
        return None
    cfg, pools = c.cfg, c.report.pools
    l1 = next((p for p in pools.values() if p.level.startswith("L1")), None)
    l2 = next((p for p in pools.values() if p.level.startswith("L2")), None)
    if l1 is None or l2 is None:
        return None
    bs = c.engine.cache.cfg.block_size
    warm = int(math.ceil(max(0, tokens - cfg.active_window) / 1024) * 1024)
    extra = l2.used_slots * l1.bytes_per_slot
    ram = available_ram()
    l1_needed = (l1.used_slots + l2.used_slots) * l1.bytes_per_slot
    if l1_needed > host_budget_gb(cfg).cpu_memory_gb * GIB:
        if ram is None or l1_needed > ram.num_bytes / 2:
            return None
        change = {"warm_tokens": warm, "cpu_memory_gb": round(math.ceil(l1_needed * 1.25 / GIB * 10) / 10, 1)}
    else:
        change = {"warm_tokens": warm}
    read_ms = c.f.get("decode_l2_read_ms", 0.0)
    bits = c.engine.cache.codecs[Level.DISK].name.upper()
    return Advice(f"L2 holds {l2_mib:.1f} MiB ({bits}, {l2.used_slots} blocks) of a "
                  f"{tokens}-token sequence while host memory has room for it in FP16 "
                  f"(+{extra / MIB:.0f} MiB)", change,
                  f"the warm span is shorter than the context: older blocks go to the disk at "
                  f"{bits} (the lossiest level) and decode steps read them back; "
                  f"warm_tokens={warm} keeps them in L1 (block size {bs})",
                  f"no L2 reads: decode_l2_read_share to 0 (now "
                  f"{c.f.get('decode_l2_read_share', 0.0):.0%}, {read_ms:.1f} ms per step), for "
                  f"{extra / MIB:.0f} MiB more host memory",
                  "decode_l2_read_share", 5)


def _slow_disk(c: Context) -> Advice | None:
    iops = c.report.disk.get("random_iops_parallel")
    if iops is None or iops >= MIN_COLD_ZONE_IOPS or c.f.get("l2_used_mib", 0.0) <= 0:
        return None
    return Advice(f"the cold zone's disk reads {iops:,.0f} random 4 KiB blocks/s (< {MIN_COLD_ZONE_IOPS:,})",
                  {"cold_zone_enabled": False}, "below 50K IOPS the cold zone is the bottleneck (seed 000 §3.3); "
                  "with it off all older KV stays in L1 (raise cpu_memory_gb if the context needs more)",
                  "no L2 reads: decode_l2_read_share to 0", "decode_l2_read_share", 4)


def _window_never_fills(c: Context) -> Advice | None:
    tokens = int(c.f.get("sequence_tokens", 0))
    cfg, plan = c.cfg, c.engine.device_plan
    if plan is None or not tokens or tokens >= cfg.active_window:
        return None
    block = c.engine.cache.cfg.block_size
    window = max(block, 1 << math.ceil(math.log2(max(tokens, block))))
    if window >= cfg.active_window:
        return None
    new = _device_parts(c, cfg.replace(active_window=window))
    old = _device_parts(c, cfg)
    if new is None or old is None or sum(old) - sum(new) <= 0:
        return None
    (old_pool, old_work), (new_pool, new_work) = old, new
    old, new = sum(old), sum(new)
    change = {"active_window": window}
    if cfg.max_gpu_memory_mb is not None:
        change["max_gpu_memory_mb"] = max(1, cfg.max_gpu_memory_mb - int((old - new) // MIB))
    return Advice(f"the window never fills: the longest sequence had {tokens} tokens, active_window is "
                  f"{cfg.active_window}", change, "L0 and the activation workspace are sized for the window at "
                  "start-up; a window the sequences never reach reserves device memory for nothing",
                  f"saves {(old - new) / MIB:.1f} MiB of device memory: the L0 pool {(old_pool - new_pool) / MIB:.1f} "
                  f"MiB (l0_capacity_mib from {c.f.get('l0_capacity_mib', 0):.1f} to about "
                  f"{c.f.get('l0_capacity_mib', 0) - (old_pool - new_pool) / MIB:.1f}), the activation workspace "
                  f"{(old_work - new_work) / MIB:.1f} MiB (an estimate)", "l0_capacity_mib")


def _l0_oversized(c: Context) -> Advice | None:
    cfg, plan = c.cfg, c.engine.device_plan
    use = c.f.get("l0_peak_use")
    if plan is None or use is None or use >= L0_OVERSIZED_USE or _window_never_fills(c) is not None:
        return None  # (a window the sequences never reach is the first thing to fix)
    block = c.engine.cache.cfg.block_size
    window_slots = cfg.active_window // block + 1
    slots = max(window_slots, math.ceil(c.f["l0_peak_slots"] * 1.25))
    needed = (plan.weights_bytes + plan.workspace_bytes + plan.filling_bytes + plan.device_staging_bytes
              + slots * plan.slot_bytes)
    budget_mb = int(math.ceil(needed / MIB))
    saving = (c.f["l0_capacity_slots"] - slots) * plan.slot_bytes
    if saving < MIB:
        return None
    return Advice(f"the L0 pool's peak use was {use:.0%} ({int(c.f['l0_peak_slots'])} of "
                  f"{int(c.f['l0_capacity_slots'])} slots)", {"max_gpu_memory_mb": budget_mb},
                  "the pool is sized for max_num_seqs sequences' windows (or for all of max_gpu_memory_mb); this "
                  "workload used a fraction of it. Size it for the sequences you serve at once: the budget "
                  f"suggested keeps {slots} slots (the peak plus 25 %)",
                  f"saves {saving / MIB:.1f} MiB of device memory: l0_capacity_mib from "
                  f"{c.f['l0_capacity_mib']:.1f} to about {c.f['l0_capacity_mib'] - saving / MIB:.1f}",
                  "l0_capacity_mib")


def _exact_selection(c: Context) -> Advice | None:
    if c.cfg.selection != "exact" or c.cfg.kv_cache != "tiered":
        return None
    reads = c.report.traffic.get("attention_reads_per_decode_step", {})
    older = sum(r["blocks_per_step"] for k, r in reads.items() if not k.startswith("L0"))  # L0 and its rows
    if older <= 0:
        return None
    return Advice(f"decode steps read every older block ({older:,.0f} block reads per step beyond L0; attention "
                  f"{c.f.get('decode_attention_ms', 0):.1f} ms, transfers {c.f.get('decode_transfers_ms', 0):.1f} "
                  "ms per step)", {"selection": "quest"},
                  "query-aware selection reads warm_budget_tokens of L1 and semantic_truncate_threshold of L2 per "
                  "step, the blocks the query needs", "decode_ms_per_step falls with the blocks read",
                  "decode_ms_per_step", 9)


def _torch_backend(c: Context) -> Advice | None:
    from flashmemory.kvcache import native

    if c.cfg.attention_backend != "torch" or c.engine.device.type != "cpu" or native.library() is None:
        return None
    return Advice(f"decode attention runs in torch ({c.f.get('decode_attention_ms', 0):.1f} ms per step) although "
                  "the native kernel builds here", {"attention_backend": "auto"},
                  "the C kernel reads INT4 / FP16 records in place and folds them into one online softmax",
                  "decode_attention_ms falls", "decode_attention_ms", 10)


def _no_native(c: Context) -> str | None:
    from flashmemory.kvcache import native

    if c.engine.device.type == "cpu" and native.library() is None:
        return ("the native kernels did not build (no C compiler, or FLASHMEMORY_NATIVE=0): decode attention, the "
                "heat MLP and the access statistics run their torch fallbacks; `flashmemory doctor` says why")
    return None


def _fp16_l0(c: Context) -> Advice | None:
    if c.cfg.kv_precision != "fp16" or c.cfg.kv_cache != "tiered":
        return None
    old, new = _device_bytes(c, c.cfg), _device_bytes(c, c.cfg.replace(kv_precision="mixed"))
    if old is None or new is None or old <= new:
        return None
    return Advice("L0 stores FP16 (kv_precision='fp16')", {"kv_precision": "mixed"},
                  "INT4 with keys grouped per channel costs +0.08 % perplexity on SmolLM2 (DESIGN §5) and a quarter "
                  "of the bytes; L1 keeps the FP16 master copies", f"saves {(old - new) / MIB:.1f} MiB of device "
                  "memory: l0_capacity_mib falls", "l0_capacity_mib", 1)


def _staging_on_cpu(c: Context) -> Advice | None:
    if c.cfg.device_staging_mb <= 0 or c.engine.device.type != "cpu":
        return None
    return Advice(f"device staging ({c.cfg.device_staging_mb:g} MiB) on a CPU host", {"device_staging_mb": 0.0},
                  "on a CPU L1 already is the compute's memory: staging only adds copies", "transfers fall and "
                  f"{c.cfg.device_staging_mb:g} MiB of the device budget come back", "decode_transfers_ms", 11)


def _uncached_reads(c: Context) -> Advice | None:
    if not c.cfg.cold_zone_uncached_reads or c.f.get("l2_used_mib", 0.0) <= 0:
        return None
    return Advice("every L2 read is dropped from the OS page cache (cold_zone_uncached_reads=True)",
                  {"cold_zone_uncached_reads": False}, "the switch makes benchmarks honest about the disk; serving, "
                  "the page cache may hold the cold file's hot pages for free", "decode_l2_read_share falls when "
                  "the file fits the page cache", "decode_l2_read_share", None)


def _threads(c: Context) -> Advice | None:
    import os

    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = torch.get_num_threads()
    if c.engine.device.type != "cpu" or threads <= cores:
        return None
    return Advice(f"torch runs {threads} threads on {cores} available cores", {"num_threads": cores},
                  "threads beyond the cores wait for each other at every operation", "decode_ms_per_step falls",
                  "decode_ms_per_step", None)


def _device_bytes(c: Context, cfg: EngineConfig) -> int | None:
    """Device bytes the start-up plan of `cfg` takes beyond the weights (workspace, filling rows, L0 pool)."""
    parts = _device_parts(c, cfg)
    return None if parts is None else sum(parts)


def _device_parts(c: Context, cfg: EngineConfig) -> tuple[int, int] | None:
    """(KV bytes: L0 pool, filling rows and staging; the workspace estimate) of the start-up plan of `cfg`."""
    engine = c.engine
    if cfg.kv_cache != "tiered":
        return None
    block = cfg.resolve_block_size(engine.max_seq_len)
    try:
        plan = plan_device(cfg, engine.model_config, engine.device_plan.weights_bytes, engine.dtype, block)
    except Exception:  # noqa: BLE001 - a configuration that does not fit has no size to compare
        return None
    return (plan.filling_bytes + plan.device_slots * plan.slot_bytes + plan.device_staging_bytes,
            plan.workspace_bytes)


RULES: tuple[Rule, ...] = (_l2_stall, _l2_stall_with_prefetch, _warm_fits_in_ram, _slow_disk, _exact_selection,
                           _torch_backend, _no_native, _window_never_fills, _l0_oversized, _fp16_l0, _staging_on_cpu,
                           _uncached_reads, _threads)


def advise(report: DiagnoseReport, engine) -> DiagnoseReport:
    """Fill the report's warnings and advice from every rule."""
    c = Context(report, engine)
    for rule in RULES:
        found = rule(c)
        if isinstance(found, Advice):
            report.advice.append(found)
            report.warnings.append(found.finding)
        elif isinstance(found, str):
            report.warnings.append(found)
    return report
