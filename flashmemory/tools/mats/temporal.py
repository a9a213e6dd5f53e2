"""MATS-1, temporal stress: random multi-sequence workloads through every level of a real TieredKVCache.

Rounds rotate through several shapes of the hierarchy (FP16 / INT4 / mixed precision, cold zone on and off, exact
and query-aware selection, both attention backends, tiny windows so blocks move L0 -> L1 -> L2 all the time, a
device pool small enough to demote under pressure). Each round builds a cache on synthetic keys and values, runs
the random workload (workload.py) until its share of the time is up, then frees everything and checks that every
level is empty. Every read is checked against the shadow; every attention output against its reference.
"""

from __future__ import annotations

import tempfile
import time
from collections import Counter
from dataclasses import dataclass

import torch

from flashmemory.kvcache.config import TieredCacheConfig
from flashmemory.kvcache.manager.blocks import Level
from flashmemory.kvcache.tiered import TieredKVCache
from flashmemory.tools.mats.accounting import check_accounting
from flashmemory.tools.mats.checker import ShadowChecker
from flashmemory.tools.mats.device import compute_device
from flashmemory.tools.mats.driver import CacheDriver
from flashmemory.tools.mats.options import MatsOptions
from flashmemory.tools.mats.progress import Progress
from flashmemory.tools.mats.report import Check, ErrorLog, LevelTally, SuiteReport, Table
from flashmemory.tools.mats.shadow import Geometry
from flashmemory.tools.mats.threads import torch_threads
from flashmemory.tools.mats.workload import RandomWorkload

GEOMETRY = Geometry()
MAX_LIVE = 4  # sequences alive at once
MAX_TOKENS = 256  # a sequence's length (32 blocks): well past the window and the warm span
ATTENTION_TOLERANCE = 1e-3  # |cache - float64 reference|: float32 accumulation is ~1e-6; a wrong block is ~1e-1
MAX_ROUND_S = 20.0  # a round's share of the time at most (many rounds: many caches built and closed)
MIN_ROUND_S = 0.3


@dataclass(frozen=True)
class StressConfig:
    """One shape of the hierarchy a round runs on."""

    name: str
    kv_precision: str  # "fp16" | "int4" | "mixed"
    cold_zone: bool
    selection: str  # "exact" | "quest"
    attention_backend: str  # "torch" | "auto" (the native kernel where it builds)
    device_slots: int
    host_slots: int
    disk_slots: int
    active_window: int = 16  # tokens: two blocks
    warm_tokens: int = 16
    level_media: tuple[tuple[Level, str], ...] = ()  # a level's storage medium by name (levels/registry.py)

    def cache_config(self, geometry: Geometry, cold_zone_dir: str,
                     device: torch.device | None = None) -> TieredCacheConfig:
        """The cache of this shape on `device` (None: the engine's compute device, device.py)."""
        # Every other KV setting is the product's default (FP16 recent rows, 4-key digest
        # boxes, the L1 fraction): MATS checks what users run. Set here on purpose: the shape
        # under test, the geometry's block, the workload's live sequences, a scratch folder,
        # and read budgets sized to its 256-token sequences (the engine's 1408 L1 tokens
        # would read every warm block and select none).
        return TieredCacheConfig(
            num_layers=geometry.num_layers, num_kv_heads=geometry.num_kv_heads,
            head_dim=geometry.head_dim, device_slots=self.device_slots,
            host_slots=self.host_slots, disk_slots=self.disk_slots if self.cold_zone else 1,
            block_size=geometry.block_size, active_window=self.active_window,
            warm_tokens=self.warm_tokens, selection=self.selection,
            kv_precision=self.kv_precision, max_num_seqs=MAX_LIVE,
            cold_zone_enabled=self.cold_zone, cold_zone_dir=cold_zone_dir,
            attention_backend=self.attention_backend,
            semantic_truncate_threshold=0.4, warm_budget_tokens=16, model_fingerprint=b"mats",
            level_media=dict(self.level_media), device=device or compute_device())


CONFIGS = (
    StressConfig("fp16 exact 3-level torch", "fp16", True, "exact", "torch", 32, 64, 160),
    StressConfig("fp16 exact 3-level native", "fp16", True, "exact", "auto", 32, 64, 160),
    StressConfig("mixed exact 3-level", "mixed", True, "exact", "auto", 32, 64, 160),
    StressConfig("int4 exact no-cold", "int4", False, "exact", "auto", 32, 160, 0),
    StressConfig("mixed quest 3-level", "mixed", True, "quest", "auto", 32, 64, 160, warm_tokens=32),
    StressConfig("fp16 exact no-cold L0-pressure", "fp16", False, "exact", "torch", 16, 160, 0),
    StressConfig("mixed exact L0+L1-pressure", "mixed", True, "exact", "auto", 16, 32, 160, active_window=24,
                 warm_tokens=8),
)


def run_temporal(options: MatsOptions, configs: tuple[StressConfig, ...] | None = None) -> SuiteReport:
    """Run MATS-1 for options.duration_s seconds; the report says what was read, how often and what was wrong."""
    configs = configs or CONFIGS
    report = SuiteReport("MATS-1", "temporal stress", options.seed, options.duration_s)
    errors, counters, tallies = ErrorLog(), Counter(), {}
    per_config = {c.name: Counter() for c in configs}
    worst_attention = 0.0
    round_s = min(MAX_ROUND_S, max(MIN_ROUND_S, options.duration_s / len(configs)))
    progress = Progress("MATS-1", options.duration_s, options.progress)
    device = compute_device()
    started = time.monotonic()
    deadline = started + options.duration_s
    with tempfile.TemporaryDirectory(prefix="flashmemory-mats-", dir=options.workdir) as folder, torch_threads(1):
        round_index = 0
        while time.monotonic() < deadline:
            config = configs[round_index % len(configs)]
            generator = torch.Generator().manual_seed(options.seed * 1_000_003 + round_index)
            round_end = min(deadline, time.monotonic() + round_s)
            stats, attention = _run_round(config.cache_config(GEOMETRY, folder, device), generator, round_end,
                                          errors, counters, tallies, progress)
            worst_attention = max(worst_attention, attention)
            per_config[config.name].update(stats)
            round_index += 1
    progress.close()
    report.elapsed_s = time.monotonic() - started
    report.ops = sum(v for k, v in counters.items() if k.startswith("op_"))
    report.take_errors(errors)
    report.levels = dict(sorted(tallies.items()))
    report.counters = dict(sorted(counters.items()))
    report.counters["rounds"] = round_index
    report.tables.append(Table("Per configuration", ["configuration", "rounds", "ops", "errors", "exact attn checks",
                                                     "L0->L1 MiB", "L1->L2 MiB"],
                               [[name, c["rounds"], c["ops"], c["errors"], c["exact"], c["L0->L1"] / 2**20,
                                 c["L1->L2"] / 2**20] for name, c in per_config.items()]))
    report.checks += [
        Check("wrong or stale reads", sum(t.errors for t in tallies.values()), "== 0",
              sum(t.errors for t in tallies.values()) == 0),
        Check("leaked slots", counters["leaked_slots"], "== 0", counters["leaked_slots"] == 0),
        Check("worst attention error", worst_attention, f"<= {ATTENTION_TOLERANCE:g}",
              worst_attention <= ATTENTION_TOLERANCE, "vs dense float64 attention over the shadow or the levels"),
    ]
    report.notes += [f"geometry: {GEOMETRY}", f"device: {device}",
                     f"{MAX_LIVE} sequences at most, {MAX_TOKENS} tokens each; "
                     f"rounds of {round_s:.1f} s rotating over {len(configs)} configurations"]
    for level in ("L0", "L1", "L2"):
        if tallies.get(level, LevelTally()).reads == 0:
            report.warnings.append(f"no read of {level} was checked (run longer)")
    return report


def _run_round(cache_config: TieredCacheConfig, generator: torch.Generator, round_end: float, errors: ErrorLog,
               counters: Counter, tallies: dict[str, LevelTally], progress: Progress) -> tuple[Counter, float]:
    """One cache, one random workload until round_end, then everything freed and the levels checked empty."""
    errors_before = errors.count
    cache = TieredKVCache(cache_config)
    checker = ShadowChecker(cache, {}, errors, tallies)
    driver = CacheDriver(cache, GEOMETRY, generator, MAX_TOKENS, errors, checker, counters, ATTENTION_TOLERANCE)
    workload = RandomWorkload(driver, checker, generator, MAX_LIVE, errors, counters)
    ops_before = sum(v for k, v in counters.items() if k.startswith("op_"))
    exact_before = counters["attention_checks_exact"]
    try:
        while time.monotonic() < round_end:
            workload.step()
            progress.update(sum(v for k, v in counters.items() if k.startswith("op_")), errors.count)
        driver.free_all()
        check_empty(cache, errors, counters)
        moved = {move.route: move.bytes for move in cache.kv_stats().moves}
    finally:
        cache.close()
    stats = Counter(rounds=1, errors=errors.count - errors_before, exact=counters["attention_checks_exact"] - exact_before,
                    ops=sum(v for k, v in counters.items() if k.startswith("op_")) - ops_before)
    stats["L0->L1"] = moved.get("L0->L1", 0)
    stats["L1->L2"] = moved.get("L1->L2", 0)
    return stats, driver.worst_attention_error


def check_empty(cache: TieredKVCache, errors: ErrorLog, counters: Counter) -> None:
    """After every sequence is freed, every allocator must be empty (any slot still in use is leaked)."""
    result = check_accounting(cache)
    counters["leaked_slots"] += result.leaked_slots
    for problem in result.problems:
        errors.add("leak" if "allocator" in problem else "accounting", f"after every sequence was freed: {problem}")
