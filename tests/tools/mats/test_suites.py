"""MATS-1 and MATS-2 for a few seconds each: a sound cache passes; a level that flips a bit on read, or a disk level
whose checksums are bypassed, is reported with errors and a non-zero exit."""

from __future__ import annotations

import dataclasses
import errno
import json
from collections import Counter

import torch

from flashmemory.kvcache.manager.blocks import Level
from flashmemory.kvcache.tiered import TieredKVCache
from flashmemory.tools import testing_cli
from flashmemory.tools.mats import coherence, temporal
from flashmemory.tools.mats.checker import ShadowChecker
from flashmemory.tools.mats.coherence import run_coherence
from flashmemory.tools.mats.driver import CacheDriver
from flashmemory.tools.mats.faults import FaultLedger
from flashmemory.tools.mats.options import MatsOptions
from flashmemory.tools.mats.progress import Progress
from flashmemory.tools.mats.report import ErrorLog
from flashmemory.tools.mats.temporal import GEOMETRY, run_temporal
from flashmemory.tools.mats.threads import torch_threads
from flashmemory.tools.mats.workload import RandomWorkload
from tests.tools.mats import broken_levels


def test_mats1_on_a_sound_cache_reads_every_level_and_finds_nothing(tmp_path):
    configs = tuple(temporal.CONFIGS[i] for i in (0, 2, 3))  # fp16 / mixed over three levels, int4 without L2
    report = run_temporal(MatsOptions(duration_s=3.0, seed=1, workdir=str(tmp_path)), configs)
    assert report.passed, report.render_text()
    assert report.errors == 0 and report.ops > 20
    assert all(report.levels[level].reads > 0 for level in ("L0", "L1"))
    assert report.counters["attention_checks_exact"] > 0 and report.counters["blocks_demoted"] > 0
    assert report.summary_line().startswith("[INFO] MATS-1: temporal stress passed (")
    assert list(tmp_path.iterdir()) == []  # the cold-zone files went with their caches


def test_mats1_reports_a_memory_level_that_flips_a_bit_on_read_and_exits_non_zero(tmp_path, monkeypatch, capsys):
    broken_levels.register(monkeypatch)
    monkeypatch.setattr(temporal, "CONFIGS", broken_levels.with_medium(temporal.CONFIGS[:1], Level.HOST,
                                                                       broken_levels.BIT_FLIPPING_HOST))
    status = testing_cli.main(["mats", "--level", "1", "--duration", "1.5", "--no-progress",
                               "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert status == 1, out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["levels"]["L1"]["errors"] > 0 and report["error_kinds"]["wrong read"] > 0
    assert "[ERROR] MATS-1: temporal stress FAILED" in out and "FP16 values differ" in out


def test_mats2_on_a_sound_cache_detects_every_injected_fault_and_serves_nothing_stale(tmp_path, monkeypatch):
    monkeypatch.setitem(coherence.WEIGHTS, "arm_flip", 15)  # plenty of faults in a few seconds, however busy the host
    report = run_coherence(MatsOptions(duration_s=4.0, seed=3, workdir=str(tmp_path)))
    assert report.passed, report.render_text()
    faults = next(t for t in report.tables if t.title == "Injected disk faults")
    injected = {row[0]: (row[1], row[2]) for row in faults.rows}
    assert injected["bit flip"][0] > 0 and injected["bit flip"][0] == injected["bit flip"][1]
    assert report.levels["L1"].reads > 0
    checks = {c.name: c for c in report.checks}
    assert checks["stale or wrong reads"].value == 0 and checks["leaked slots"].value == 0


def test_mats2_a_deleted_cold_file_is_recovered_with_every_record_intact(tmp_path, monkeypatch):
    monkeypatch.setitem(coherence.WEIGHTS, "delete", 8)  # many deletions in a few seconds
    report = run_coherence(MatsOptions(duration_s=4.0, seed=6, workdir=str(tmp_path)))
    assert report.passed, report.render_text()
    faults = next(t for t in report.tables if t.title == "Injected disk faults")
    injected = {row[0]: (row[1], row[2]) for row in faults.rows}
    assert injected["deletion"][0] > 0 and injected["deletion"][0] == injected["deletion"][1]
    assert report.counters["deleted_files_recovered"] == injected["deletion"][0]


def test_mats2_races_the_prefetcher_however_short_the_run(tmp_path):
    report = run_coherence(MatsOptions(duration_s=0.2, seed=4, workdir=str(tmp_path)))
    assert report.passed, report.render_text()
    assert report.counters["prefetch_issued"] > 0
    assert report.counters["prefetch_completed"] + report.counters["prefetch_dropped_races"] > 0
    checks = {c.name: c for c in report.checks}
    assert checks["prefetch reads raced"].passed and checks["prefetch reads raced"].value > 0


def test_mats2_reports_a_disk_level_whose_checksums_are_bypassed_and_exits_non_zero(tmp_path, monkeypatch, capsys):
    broken_levels.register(monkeypatch)
    monkeypatch.setitem(coherence.WEIGHTS, "arm_flip", 15)
    monkeypatch.setattr(coherence, "CONFIGS", broken_levels.with_medium(coherence.CONFIGS[:1], Level.DISK,
                                                                        broken_levels.UNCHECKED_DISK))
    status = testing_cli.main(["mats", "--level", "2", "--duration", "3", "--seed", "5", "--no-progress",
                               "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert status == 1, out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["error_kinds"]["undetected fault"] > 0
    assert report["error_kinds"]["wrong read"] > 0  # the corrupt bytes reached the read path
    assert "[ERROR] MATS-2: level coherence FAILED" in out


def test_the_same_seed_makes_the_same_operations(tmp_path):
    def run(seed: int) -> Counter:
        cache = TieredKVCache(temporal.CONFIGS[0].cache_config(GEOMETRY, str(tmp_path)))
        errors, counters = ErrorLog(), Counter()
        generator = torch.Generator().manual_seed(seed)
        checker = ShadowChecker(cache, {}, errors, {})
        driver = CacheDriver(cache, GEOMETRY, generator, temporal.MAX_TOKENS, errors, checker, counters, 1e-3)
        workload = RandomWorkload(driver, checker, generator, temporal.MAX_LIVE, errors, counters)
        for _ in range(80):
            workload.step()
        cache.close()
        return counters

    with torch_threads(1):
        assert run(7) == run(7) != run(8)



def test_a_block_write_refused_in_the_middle_of_a_commit_is_contained_without_false_errors(tmp_path):
    """Ten new blocks into tiny pools: the seventh pushes an older block to L2, and that write fails. The blocks
    written before it sit in the table past the committed tokens; MATS checks only committed ones and drops the
    sequence, as the engine does (a run that touched them reported wrong reads that were its own)."""
    config = coherence.CONFIGS[0]
    small = dataclasses.replace(config.cache_config(str(tmp_path)), device_slots=4, host_slots=6)
    errors, counters, ledger = ErrorLog(), Counter(), FaultLedger()
    with torch_threads(1):
        round_ = coherence.Round(config, 0, str(tmp_path), errors, counters, {}, ledger, Progress("", 1, False),
                                 cache_config=small)
        seq_id = round_.driver.add()
        round_.driver.forward([(seq_id, 16)])
        round_.io.write_errors_armed.append(errno.ENOSPC)
        round_.driver.forward([(seq_id, 80)])
        assert counters["sequences_failed_full"] == 1 and seq_id not in round_.driver.live
        assert errors.count == 0, errors.samples
        assert [(f.kind, f.detected) for f in ledger.faults] == [("ENOSPC", True)]
        assert all(a.num_used == 0 for a in round_.cache.blocks.allocators.values())
        round_.cache.close()
