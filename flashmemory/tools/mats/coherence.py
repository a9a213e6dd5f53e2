"""MATS-2, level coherence: prefetch, device staging, rewrites, evictions and aborts racing over a
faulty disk.

Each round builds a TieredKVCache with query-aware selection, the Prefetcher's reader threads and
DeviceStaging's copier thread, pools small enough that blocks are evicted under pressure and slots
are rewritten soon after they are freed, and a cold-zone file whose I/O injects faults (faults.py):
bit flips in what reads return, ENOSPC on block writes, slow reads, the file truncated or deleted
under the cache (a deleted file must be re-created with its records intact). The random workload
runs with a decode-heavy mix plus direct reads through the prefetcher and the staging area. Every
byte the prefetch subsystem serves is checked against the shadow (read_watch.py); every injected
fault must end in a ColdBlockError or ColdZoneFullError (or a recovery checked against the shadow)
and never be served; no slot may leak, and once every sequence is freed nothing may stay staged.
However short the run, every round ends only once the prefetcher's reader threads have read ahead
(prefetch_race.py), and the report fails a run in which they read nothing. The engine case
(reuse_faults.py) ends the run.
"""

from __future__ import annotations

import errno
import logging
import os
import tempfile
import time
from collections import Counter
from dataclasses import dataclass

import torch

from flashmemory.errors import ColdBlockError, ColdZoneFullError, ColdZoneWriteError
from flashmemory.kvcache.config import TieredCacheConfig
from flashmemory.kvcache.kv_stats import KVStats
from flashmemory.kvcache.manager.blocks import Level
from flashmemory.kvcache.tiered import TieredKVCache
from flashmemory.model.default_model import default_model_path
from flashmemory.tools.mats.accounting import staged_bytes
from flashmemory.tools.mats.checker import ShadowChecker
from flashmemory.tools.mats.device import compute_device
from flashmemory.tools.mats.driver import CacheDriver
from flashmemory.tools.mats.faults import FaultLedger, FaultyDiskIO
from flashmemory.tools.mats.options import MatsOptions
from flashmemory.tools.mats.prefetch_race import prefetch_reads, race_prefetcher
from flashmemory.tools.mats.progress import Progress
from flashmemory.tools.mats.read_watch import (CheckedPerHeadSource, CheckedReadThrough, check_per_head,
                                               watch_segment_reads)
from flashmemory.tools.mats.report import Check, ErrorLog, SuiteReport, Table
from flashmemory.tools.mats.reuse_faults import report_reuse_faults, run_reuse_faults
from flashmemory.tools.mats.shadow import Geometry
from flashmemory.tools.mats.threads import torch_threads
from flashmemory.tools.mats.temporal import ATTENTION_TOLERANCE, MAX_LIVE, MAX_TOKENS, check_empty
from flashmemory.tools.mats.workload import BASE_WEIGHTS, RandomWorkload

GEOMETRY = Geometry()
ENGINE_SHARE = 0.2  # of the duration: the engine case through the prefix-reuse path (at least its trials)
ENGINE_MIN_TRIALS = 3  # one of each fault kind
ROUND_S = (0.5, 15.0)  # a round's share of the time, at least and at most
SLOW_READ_PROBABILITY = 0.2
STAGING_MB = 16 / 1024  # 16 KiB each for prefetched L2 blocks and L1 blocks staged on the device
DRAIN_TIMEOUT_S = 2.0  # staging must be empty this soon after every sequence is freed
# Decode-heavy (decode steps drive prefetch) with long-lived sequences (blocks reach L2), faults now and then.
WEIGHTS = {**BASE_WEIGHTS, "prefill": 15, "decode": 40, "read": 10, "demote": 2, "promote": 3, "free": 1, "abort": 1,
           "prefetch_read": 8, "staging_gather": 6, "arm_flip": 1.5, "arm_write_error": 0.3, "truncate": 0.1,
           "delete": 0.03}
# What the report counts after each round, read from the cache's typed stats (kvcache/kv_stats.py).
PREFETCH_COUNTERS = ("prefetch_issued", "prefetch_completed", "prefetch_hits", "prefetch_misses",
                     "prefetch_late_misses", "prefetch_dropped_races")
STAGING_COUNTERS = ("device_staging_issued", "device_staging_hits", "device_staging_misses")
DISK_COUNTERS = ("load_failures_checksum", "load_failures_truncated", "load_failures_missing",
                 "load_failures_header", "write_failures_full", "write_failures_io")  # L2's


@dataclass(frozen=True)
class CoherenceConfig:
    """One shape of the racing subsystems a round runs on."""

    name: str
    kv_precision: str
    attention_backend: str  # "torch" reads L1 selections through device staging; the native kernel reads in place
    prefetch_strategy: str  # "adaptive" | "aggressive"
    prefetch_ranker: str  # "predictor" | "lru"
    level_media: tuple[tuple[Level, str], ...] = ()  # a level's storage medium by name (levels/registry.py)

    def cache_config(self, cold_zone_dir: str, device: torch.device | None = None) -> TieredCacheConfig:
        """The cache of this shape on `device` (None: the engine's compute device, device.py)."""
        g = GEOMETRY
        # Every other KV setting is the product's default (FP16 recent rows, 4-key digest
        # boxes, the L1 fraction): MATS checks what users run. Set here on purpose: the shape
        # under test, pools and windows small enough that blocks are evicted and rewritten
        # often, read budgets sized to these short sequences, staging areas of a few blocks.
        return TieredCacheConfig(
            num_layers=g.num_layers, num_kv_heads=g.num_kv_heads, head_dim=g.head_dim,
            device_slots=20, host_slots=40, disk_slots=160, block_size=g.block_size,
            active_window=16, warm_tokens=48, semantic_truncate_threshold=0.2,
            # No floor under the L2 budget: with the engine's 256 tokens a step would read every cold block of
            # these short sequences, and the prefetcher, finding all of them read already, would read nothing.
            selection_min_tokens=0, warm_budget_tokens=16, selection="quest", kv_precision=self.kv_precision,
            max_num_seqs=MAX_LIVE,
            cold_zone_dir=cold_zone_dir, model_fingerprint=b"mats", prefetch_strategy=self.prefetch_strategy,
            prefetch_ranker=self.prefetch_ranker, prefetch_budget_mb=STAGING_MB,
            device_staging_mb=STAGING_MB,
            attention_backend=self.attention_backend, level_media=dict(self.level_media),
            device=device or compute_device())


CONFIGS = (
    CoherenceConfig("mixed adaptive predictor torch", "mixed", "torch", "adaptive", "predictor"),
    CoherenceConfig("fp16 aggressive lru torch", "fp16", "torch", "aggressive", "lru"),
    CoherenceConfig("int4 adaptive predictor native", "int4", "auto", "adaptive", "predictor"),
)


def run_coherence(options: MatsOptions, configs: tuple[CoherenceConfig, ...] | None = None) -> SuiteReport:
    """Run MATS-2 for options.duration_s seconds."""
    configs = configs or CONFIGS
    report = SuiteReport("MATS-2", "level coherence", options.seed, options.duration_s)
    errors, counters, tallies, ledger = ErrorLog(), Counter(), {}, FaultLedger()
    round_s = min(ROUND_S[1], max(ROUND_S[0], options.duration_s / (2 * len(configs))))
    progress = Progress("MATS-2", options.duration_s, options.progress)
    device = compute_device()
    started = time.monotonic()
    deadline = started + options.duration_s
    cache_deadline = started + (1 - ENGINE_SHARE) * options.duration_s  # then the engine case (reuse_faults.py)
    model = options.model or str(default_model_path())
    with tempfile.TemporaryDirectory(prefix="flashmemory-mats-", dir=options.workdir) as folder, torch_threads(1):
        index = 0
        while time.monotonic() < cache_deadline:
            config = configs[index % len(configs)]
            seed = options.seed * 1_000_003 + index
            Round(config, seed, folder, errors, counters, tallies, ledger, progress,
                  config.cache_config(folder, device)).run(min(deadline, time.monotonic() + round_s))
            counters[f"rounds {config.name}"] += 1
            index += 1
        reuse = run_reuse_faults(model, folder, options.seed, deadline, ENGINE_MIN_TRIALS)
    progress.close()
    report.elapsed_s = time.monotonic() - started
    report.ops = sum(v for k, v in counters.items() if k.startswith("op_"))
    for fault in ledger.undetected():
        errors.add("undetected fault", f"{fault.kind} ({fault.where}) was "
                                       f"{'served' if fault.served else 'never reported'}")
    report.take_errors(errors)
    report.levels = dict(sorted(tallies.items()))
    report.counters = dict(sorted(counters.items()))
    injected, detected = ledger.injected(), ledger.detected()
    report.tables.append(Table("Injected disk faults", ["fault", "injected", "detected"],
                               [[kind, n, detected[kind]] for kind, n in sorted(injected.items())]
                               + [["slow read (timing only)", counters["slow_reads"], "-"]]))
    wrong = errors.by_kind["wrong read"] + errors.by_kind["stale read"]
    raced = prefetch_reads(counters)
    report.checks += [
        Check("prefetch reads raced", raced, "> 0", raced > 0),
        Check("stale or wrong reads", wrong, "== 0", wrong == 0),
        Check("leaked slots", counters["leaked_slots"], "== 0", counters["leaked_slots"] == 0),
        Check("staging left after free", counters["staged_bytes_left"], "== 0", counters["staged_bytes_left"] == 0),
        Check("faults detected", f"{sum(detected.values())} of {sum(injected.values())}", "all",
              sum(detected.values()) == sum(injected.values())),
    ]
    report.notes += [f"geometry: {GEOMETRY}", f"device: {device}",
                     f"rounds of {round_s:.1f} s over {len(configs)} configurations: "
                     + "; ".join(c.name for c in configs)]
    if not injected:
        report.warnings.append("no disk fault was injected (run longer)")
    report_reuse_faults(report, reuse, model)
    return report


class Round:
    """One cache with its faulty disk, driven until the round's end (or until its file is deleted)."""

    def __init__(self, config: CoherenceConfig, seed: int, folder: str, errors: ErrorLog, counters: Counter,
                 tallies: dict, ledger: FaultLedger, progress: Progress,
                 cache_config: TieredCacheConfig | None = None) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.errors, self.counters, self.ledger, self.progress = errors, counters, ledger, progress
        self.cache = _quiet_build(cache_config or config.cache_config(folder))
        self.pool = self.cache.disk_pool
        self.io = FaultyDiskIO(ledger, seed)
        self.io.slow_read_probability = SLOW_READ_PROBABILITY
        self.pool.io = self.io
        watch_segment_reads(self.pool, ledger)
        self.checker = ShadowChecker(self.cache, {}, errors, tallies)
        self.driver = CacheDriver(self.cache, GEOMETRY, self.generator, MAX_TOKENS, errors, self.checker, counters,
                                  ATTENTION_TOLERANCE, on_fault=self.on_fault, quiet=self.io.quiet)
        self.cache.reader.use_read_through(Level.DISK, CheckedReadThrough(self.cache.prefetcher, self.checker))
        if self.cache.device_staging is not None:
            self.cache.reader.use_per_head_source(Level.HOST, CheckedPerHeadSource(self.cache.device_staging,
                                                                                   self.checker))
        self.file_deleted = False
        extra = {"prefetch_read": self.op_prefetch_read, "staging_gather": self.op_staging_gather,
                 "arm_flip": self.op_arm_flip, "arm_write_error": self.op_arm_write_error, "truncate": self.op_truncate,
                 "delete": self.op_delete}
        self.workload = RandomWorkload(self.driver, self.checker, self.generator, MAX_LIVE, errors, counters,
                                       WEIGHTS, extra)

    def run(self, round_end: float) -> None:
        try:
            while time.monotonic() < round_end and not self.file_deleted:
                self.workload.step()
                self.progress.update(sum(v for k, v in self.counters.items() if k.startswith("op_")),
                                     self.errors.count, faults=len(self.ledger.faults))
            self.counters["prefetch_race_steps"] += race_prefetcher(self.driver, MAX_LIVE, lambda: self.file_deleted)
            self.io.flips_armed = self.io.background_flips_armed = 0
            self.io.write_errors_armed.clear()
            self.driver.free_all()
            check_empty(self.cache, self.errors, self.counters)
            self._check_drained()
            self.counters.update(round_counters(self.cache.kv_stats()))
        finally:
            self.cache.close()
            self.counters["slow_reads"] += self.io.slow_reads

    def _check_drained(self) -> None:
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        left = staged_bytes(self.cache)
        while any(left.values()) and time.monotonic() < deadline:
            time.sleep(0.01)
            left = staged_bytes(self.cache)
        for what, n in left.items():
            if n:
                self.counters["staged_bytes_left"] += n
                self.errors.add("leak", f"{what} = {n} after every sequence was freed")

    # ---- faults -----------------------------------------------------------------------------------------------

    def on_fault(self, error: Exception) -> None:
        """A cold-zone failure the driver contained. A refused write must leave the sequence's blocks intact (the
        block it was moving stays in L1) before the sequence is failed (full disk) or recomputed (I/O error)."""
        self.counters[f"faults_contained_{type(error).__name__}"] += 1
        if isinstance(error, (ColdZoneFullError, ColdZoneWriteError)):
            self.ledger.resolve("write", detected=True)
            seq_id = getattr(error, "seq_id", None)
            if seq_id in self.driver.live:
                self._check_sequence(seq_id)

    def _check_sequence(self, seq_id: int) -> None:
        """Read every copy of the sequence's committed blocks (memory levels only: the disk may be the faulty part).

        NOTE: a write refused part-way through a commit leaves the blocks written before it in the table, past the
        sequence's committed tokens; the engine drops them with the sequence (failed or recomputed), so they are
        not checked here."""
        committed = self.driver.live[seq_id].num_cached // GEOMETRY.block_size
        for index, block in enumerate(self.cache.blocks.tables[seq_id].blocks[:committed]):
            for level, slot in block.slots.items():
                if level != Level.DISK:
                    self.checker.check(level, seq_id, index, self.cache.levels[level].read_block(slot), None,
                                       "after a refused write")

    def _cold_blocks(self) -> list[tuple[int, int, int]]:
        return [(seq_id, index, block.slots[Level.DISK]) for seq_id, table in self.cache.blocks.tables.items()
                for index, block in enumerate(table.blocks) if Level.DISK in block.slots]

    def _pick(self, items: list):
        return items[int(torch.randint(0, len(items), (1,), generator=self.generator))]

    def op_arm_flip(self) -> bool:
        """Flip a bit in the next read or two; every other time in a prefetch reader thread's next read."""
        n = int(torch.randint(1, 3, (1,), generator=self.generator))
        if self.counters["op_arm_flip"] % 2:
            self.io.background_flips_armed += n
        else:
            self.io.flips_armed += n
        return True

    def op_arm_write_error(self) -> bool:
        """Fail the next block write: a full disk (ENOSPC) three times in four, an I/O error (EIO) otherwise."""
        full = self.counters["op_arm_write_error"] % 4 != 3
        self.io.write_errors_armed.append(errno.ENOSPC if full else errno.EIO)
        return True

    def op_truncate(self) -> bool:
        """Cut the file inside a live cold block's record; reading that block must fail."""
        cold = self._cold_blocks()
        if not cold:
            return False
        _, _, slot = self._pick(cold)
        start = slot * self.pool.record_bytes
        end = start + self.pool.header_bytes + self.pool.num_layers * self.pool.segment_bytes
        cut = int(torch.randint(start, end, (1,), generator=self.generator))
        os.truncate(self.pool.path, cut)
        self._expect_lost("truncation", f"file cut at byte {cut}, inside slot {slot}", slot)
        return True

    def op_delete(self) -> bool:
        """Delete the file under the cache. The pool re-creates it from its open descriptor with the live records
        carried over, so a cold block must still read back what was written (checked against the shadow); where
        it cannot, the read must fail, and the round ends."""
        cold = self._cold_blocks()
        if not cold:
            return False
        name = self.pool.path.name
        os.unlink(self.pool.path)
        slot = self._pick(cold)[2]
        fault = self.ledger.inject("deletion", f"{name} deleted")
        layer = self.pool.num_layers - 1
        try:
            with self.io.quiet():
                parts = self.pool.read_layer([slot], layer)
        except ColdBlockError as error:
            fault.detected = True  # not recovered, but never served: the round ends on a lost file
            self.counters[f"fault_reads_failed_{error.reason}"] += 1
            self.file_deleted = True
            return True
        wrong = self.checker.check_layer(Level.DISK, [slot], parts, layer, "read after its file was deleted")
        fault.detected = wrong == 0  # recovered intact (a wrong read is counted as one by the checker)
        fault.served = not fault.detected
        self.counters["deleted_files_recovered"] += fault.detected
        return True

    def _expect_lost(self, kind: str, where: str, slot: int) -> None:
        fault = self.ledger.inject(kind, where)
        try:
            with self.io.quiet():
                self.pool.read_layer([slot], self.pool.num_layers - 1)  # the record's last segment: past any cut
        except ColdBlockError as error:
            fault.detected = True
            self.counters[f"fault_reads_failed_{error.reason}"] += 1
        else:
            fault.served = True

    # ---- direct reads through the racing subsystems -------------------------------------------------------------

    def op_prefetch_read(self) -> bool:
        cold = self._cold_blocks()
        if not cold or self.cache.prefetcher is None:
            return False
        seq_id = self._pick(cold)[0]
        slots = [slot for s, _, slot in cold if s == seq_id]
        chosen = [slots[i] for i in torch.randperm(len(slots), generator=self.generator)[:4].tolist()]
        layer = int(torch.randint(0, GEOMETRY.num_layers, (1,), generator=self.generator))
        parts = self.cache.prefetcher.read_layer(chosen, layer, seq_id, decoding=False)
        self.checker.check_layer(Level.DISK, chosen, parts, layer, "read through the prefetcher")
        return True

    def op_staging_gather(self) -> bool:
        staging = self.cache.device_staging
        warm = [block.slots[Level.HOST] for table in self.cache.blocks.tables.values() for block in table.blocks
                if Level.HOST in block.slots]
        if staging is None or not warm:
            return False
        picks = torch.randint(0, len(warm), (GEOMETRY.num_kv_heads, 2), generator=self.generator)
        slots = torch.tensor(warm)[picks]  # [kv_heads, 2]: each KV head its own blocks
        layer = int(torch.randint(0, GEOMETRY.num_layers, (1,), generator=self.generator))
        check_per_head(self.checker, slots, staging.gather_parts(layer, slots), layer, "gathered from staging")
        return True


def _quiet_build(config: TieredCacheConfig) -> TieredKVCache:
    """Build the cache without the one-line warning that device staging on a CPU host only adds copies (true, and
    the point here: its copier thread is one of the racers)."""
    log = logging.getLogger("flashmemory.kvcache.prefetch")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        return TieredKVCache(config)
    finally:
        log.setLevel(level)


def round_counters(stats: KVStats) -> dict[str, int]:
    """The prefetcher's, device staging's and L2 medium's counters a round reports (0 for a part
    not run)."""
    cold = stats.level("L2")
    out = {key: int(getattr(stats.prefetch, key)) if stats.prefetch else 0
           for key in PREFETCH_COUNTERS}
    out.update({key: int(getattr(stats.staging, key)) if stats.staging else 0
                for key in STAGING_COUNTERS})
    out.update({f"L2_{key}": int(getattr(cold.medium, key) or 0) if cold else 0
                for key in DISK_COUNTERS})
    return out
