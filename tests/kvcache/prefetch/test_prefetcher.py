"""Prefetch of L2 segments: byte-identical to direct reads, never half-written or stale, counted, and harmless."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from flashmemory import FlashMemoryEngine
from flashmemory.errors import ConfigError
from flashmemory.kvcache.prefetch.access_stats import FEATURE_NAMES
from flashmemory.kvcache.read.choice import LayerChoice
from flashmemory.kvcache.levels.disk_pool import DiskPool
from flashmemory.kvcache.prefetch.prefetcher import Prefetcher
from flashmemory.kvcache.quant import Codec

LAYERS, HEADS, BS, DIM, SLOTS = 2, 2, 16, 32, 8


@pytest.fixture
def pool(tmp_path):
    p = DiskPool(Codec(2, BS, 16), num_slots=SLOTS, num_layers=LAYERS, num_kv_heads=HEADS, block_size=BS,
                 head_dim=DIM, directory=tmp_path, model_fingerprint=b"m")
    for slot in range(SLOTS):
        g = torch.Generator().manual_seed(slot)
        p.put(slot, p.codec.encode(torch.randn(LAYERS, HEADS, BS, DIM, generator=g),
                                   torch.randn(LAYERS, HEADS, BS, DIM, generator=g)))
    yield p
    p.close()


class _LowestFirst:
    """A stand-in ranker: the lowest logical blocks are hottest (or the highest, when flipped)."""

    flipped = False

    def rank(self, features: torch.Tensor) -> torch.Tensor:
        position = features[FEATURE_NAMES.index("position")]
        return position if self.flipped else -position


def _prefetcher(pool, ranker=None, threads=2) -> Prefetcher:
    return Prefetcher(pool, LAYERS, HEADS, "adaptive", budget_bytes=1 << 20, ranker="predictor", predictor=ranker or _LowestFirst(), num_threads=threads)


def _choose(pf: Prefetcher, step: int, layer: int, chosen: list[list[int]]) -> None:
    """Tell the prefetcher that `layer` chose these blocks (per head) among all SLOTS blocks at `step` (logical
    block i lives in L2 slot i)."""
    ids = torch.arange(SLOTS)
    pf.on_choose(LayerChoice(0, step, layer, 2, ids, torch.zeros(HEADS, SLOTS), torch.tensor(chosen),
                             torch.zeros(HEADS), SLOTS + 4, ids))


def _wait_idle(pf: Prefetcher, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with pf._lock:
            if not pf._queue and pf.counters["prefetch_completed"] + pf.counters["prefetch_dropped_races"] >= \
                    pf.counters["prefetch_issued"]:
                return
        time.sleep(0.01)
    raise AssertionError("prefetch threads did not finish")


def test_prefetched_segments_are_byte_identical_to_direct_reads_and_counted(pool):
    ranker = _LowestFirst()
    pf = _prefetcher(pool, ranker)
    try:
        _choose(pf, 10, 1, [[1, 4], [2, 4]])  # the ranker wants {0, 1} for the next step
        pf.get_layer([1, 2, 4], 1, seq_id=0)  # this step's read: all from disk
        pf.on_step_end(0)  # ranked: 0 and 1 wanted; 1 stays staged (read-through), 2 and 4 are dropped
        _wait_idle(pf)
        assert pf.counters["prefetch_issued"] == 1 and pf.counters["prefetch_completed"] == 1  # 1 is staged already
        _choose(pf, 11, 1, [[0, 1], [0, 5]])
        got = pf.get_layer([0, 1, 5], 1, seq_id=0)
        pf.on_step_end(0)
        want = pool.get_layer([0, 1, 5], 1)
        for name in want:
            assert torch.equal(got[name], want[name])
        stats = pf.stats()
        assert stats["prefetch_hits"] == 2 and stats["prefetch_misses"] == 4  # 0 prefetched, 1 kept; 5 not wanted
        assert stats["prefetch_hit_rate"] == pytest.approx(2 / 6) and stats["predictor_ms"] > 0
        ranker.flipped = True
        _choose(pf, 12, 1, [[2, 3], [2, 3]])
        pf.get_layer([2, 3], 1, seq_id=0)
        pf.on_step_end(0)  # then {6, 7} are wanted and read ahead
        _wait_idle(pf)
        assert pf.stats()["prefetch_wasted_bytes"] == 0  # the prefetched segment of 0 had been used
        ranker.flipped = False
        _choose(pf, 13, 1, [[3], [3]])
        pf.get_layer([3], 1, seq_id=0)
        pf.on_step_end(0)
        _wait_idle(pf)
        assert pf.stats()["prefetch_wasted_bytes"] == 2 * pool.segment_bytes  # 6 and 7 were never read
    finally:
        pf.close()


def test_segment_being_read_is_never_served_and_a_rewritten_slot_is_never_stale(pool, monkeypatch):
    pf = _prefetcher(pool, threads=1)
    started, release = threading.Event(), threading.Event()
    real = pool.read_segment

    def slow(slot, layer, count_failures=True):
        if threading.current_thread().name.startswith("flashmemory-prefetch"):
            started.set()
            release.wait(5)
        return real(slot, layer, count_failures)

    monkeypatch.setattr(pool, "read_segment", slow)
    try:
        _choose(pf, 5, 0, [[2], [2]])
        pf.get_layer([2], 0, seq_id=0)
        pf.on_step_end(0)  # then block 0 is wanted: the (slow) prefetch read starts
        assert started.wait(5)
        _choose(pf, 6, 0, [[0], [0]])
        before = pf.get_layer([0], 0, seq_id=0)  # in flight: the step reads slot 0 itself, never a partial copy
        assert pf.counters["prefetch_hits"] == 0 and pf.counters["prefetch_late_misses"] == 1
        assert torch.equal(before["codes"], real_layer(pool, 0)["codes"])
        pf.on_step_end(0)
        g = torch.Generator().manual_seed(99)
        new = pool.codec.encode(torch.randn(LAYERS, HEADS, BS, DIM, generator=g),
                                torch.randn(LAYERS, HEADS, BS, DIM, generator=g))
        pool.put(0, new)  # rewritten while the older prefetch read is still in flight
        release.set()
        _wait_idle(pf)
        _choose(pf, 7, 0, [[0], [0]])
        got = pf.get_layer([0], 0, seq_id=0)
        for name in got:
            assert torch.equal(got[name][0], new[name][0])  # the new bytes, not a staged old copy
        assert pf.counters["prefetch_hits"] == 0
        assert pool.load_failures["checksum"] == 0  # a lost race is not a disk fault
    finally:
        release.set()
        pf.close()


def real_layer(pool, slot):
    return pool.unflatten(pool.read_segment(slot, 0), 1)


def test_prefetcher_rejects_an_unknown_strategy(pool):
    with pytest.raises(ConfigError, match="prefetch_strategy"):
        Prefetcher(pool, LAYERS, HEADS, "none", 1 << 20, ranker="lru")
    with pytest.raises(ConfigError, match="prefetch_ranker"):
        Prefetcher(pool, LAYERS, HEADS, "adaptive", 1 << 20, ranker="magic")


def test_engine_output_is_identical_with_prefetch_and_stats_move(tiny_llama):
    levels = dict(block_size=8, active_window=16, warm_tokens=16, prefill_chunk_tokens=32, cpu_memory_gb=0.01,
                  cold_zone_gb=0.01, semantic_truncate_threshold=0.3, warm_budget_tokens=8,
                  selection_min_tokens=0)
    ids = torch.randint(3, 300, (100,), generator=torch.Generator().manual_seed(3)).tolist()
    outputs, stats = [], []
    for knobs in ({}, {"prefetch_strategy": "aggressive", "prefetch_ranker": "lru"},
                  {"prefetch_strategy": "adaptive", "prefetch_ranker": "lru", "cold_zone_uncached_reads": True},
                  {"prefetch_strategy": "aggressive"}):  # the shipped heat predictor
        engine = FlashMemoryEngine(model_path=str(tiny_llama), **levels, **knobs)
        outputs.append(engine.score_tokens(ids, num_teacher_forced=30).decode_logprobs)
        stats.append(engine.stats())
        engine.close()
    assert all(torch.equal(outputs[0], out) for out in outputs[1:])
    assert "prefetch_hits" not in stats[0]
    for s in stats[1:]:
        assert s["prefetch_hits"] > 0 and s["L2_load_failures_checksum"] == 0
    assert stats[1]["prefetch_issued"] > 0  # aggressive reads twice the budget ahead; adaptive LRU starts at 1x
    assert stats[3]["predictor_ms"] > 0 and stats[3]["prefetch_issued"] > 0


def test_two_sequences_decoding_in_one_batch_prefetch_each_their_own_blocks(tiny_llama):
    """The server's case: one forward carries several sequences' decode steps; each gets its own statistics,
    wanted sets and step end, and the logits equal the run without prefetch."""
    from flashmemory.kvcache.interface import ForwardBatch

    levels = dict(block_size=8, active_window=16, warm_tokens=16, prefill_chunk_tokens=32, cpu_memory_gb=0.01,
                  cold_zone_gb=0.01, semantic_truncate_threshold=0.3, warm_budget_tokens=8, max_num_seqs=2,
                  selection_min_tokens=0)
    gen = torch.Generator().manual_seed(8)
    prompts = {1: torch.randint(3, 300, (90,), generator=gen).tolist(),
               2: torch.randint(3, 300, (70,), generator=gen).tolist()}
    runs = []
    for knobs in ({}, {"prefetch_strategy": "aggressive"}):
        engine = FlashMemoryEngine(model_path=str(tiny_llama), **levels, **knobs)
        cache = engine.cache
        for seq, ids in prompts.items():
            cache.add_sequence(seq)
            engine.forward_tokens(seq, ids)
        logits = []
        for step in range(12):
            batch = ForwardBatch.build([(seq, cache.num_tokens(seq), 1) for seq in prompts], engine.device)
            ids = torch.tensor([3 + step, 40 + step], dtype=torch.long)
            logits.append(engine.model(ids, cache, batch, logits_indices=torch.arange(2)))
            cache.commit(batch)
        stats = engine.stats()
        if cache.prefetcher is not None:
            assert set(cache.prefetcher.stats_by_seq) == {1, 2}
            cache.free_sequence(1)
            assert set(cache.prefetcher.stats_by_seq) == {2} and all(k[0] != 1 for k in cache.prefetcher._wanted)
        runs.append((torch.stack(logits), stats))
        engine.close()
    assert torch.equal(runs[0][0], runs[1][0])
    assert runs[1][1]["prefetch_hits"] > 0 and runs[1][1]["L2_load_failures_checksum"] == 0
