"""placement_policy="locality": the tracker's access-locality index from the choices it is told
of, and the tiered cache placing blocks by it: a block every choice picks gets an L0 copy (from the
disk level: an L1 copy too), a block no choice picks leaves L1 early, nothing moves while the link
is saturated, the age rule does none of this (synthetic K/V on the tiny model's geometry)."""

from __future__ import annotations

import pytest
import torch

from flashmemory.kvcache import locality as locality_module
from flashmemory.kvcache.locality import LinkMonitor, LocalityTracker
from flashmemory.kvcache.manager.blocks import Level
from flashmemory.kvcache.manager.policy import BlockLocality, LocalityPolicy
from flashmemory.kvcache.read.choice import LayerChoice
from flashmemory.kvcache.tiered import TieredKVCache
from tests.kvcache.synthetic import SyntheticSequence, tiny_config

# 8-token blocks: the window is blocks of age 0-1, L1 by age 2-3, the disk level from age 4; one
# L1 block and a fifth of L2's attended per KV head, no floor.
SPARSE = dict(selection_min_tokens=0, warm_budget_tokens=8, semantic_truncate_threshold=0.2)
LOCALITY = dict(placement_policy="locality", locality_history_steps=4, locality_device_tokens=16,
                locality_host_tokens=16)


def _choice(seq_id: int, layer: int, indices: list[int], chosen: list[list[int]]) -> LayerChoice:
    heads = len(chosen)
    n = len(indices)
    return LayerChoice(seq_id, 0, layer, 1, torch.tensor(indices), torch.zeros(heads, n),
                       torch.tensor(chosen), torch.zeros(heads), num_blocks=10, slots=None)


def test_the_index_is_the_share_of_cells_that_chose_a_block_over_its_last_candidate_steps():
    tracker = LocalityTracker(history_steps=3)
    for step in range(5):
        for layer in range(2):
            # two blocks a head: block 3 every cell; 5 and 6 one head of two, then 6 both; 7 never
            chosen = [[0, 1], [0, 2]] if step < 3 else [[0, 2], [0, 2]]
            tracker.on_choose(_choice(1, layer, [3, 5, 6, 7, 8, 9, 10, 11], chosen))
        tracker.on_step_end(1)
    seen = tracker.locality(1, 10)
    # 2 of 8 candidates a head: a block chosen at random would have a quarter of the choices
    assert seen[3] == BlockLocality(1.0, 3, 3, base=0.25)
    assert seen[7] == BlockLocality(0.0, 3, 3, base=0.25)  # a full window without a choice
    # the ring holds steps 2-4: block 5 by half the cells once (1/6: left to the age rule)
    assert 5 not in seen and seen[6].ali == pytest.approx(2.5 / 3)
    tracker.on_choose(_choice(1, 0, [3, 7], [[1], [1]]))
    tracker.on_step_abort(1)  # an aborted step leaves nothing behind
    for _ in range(5):  # steps where 3 and 7 are no candidates (read from L0): kept as measured
        tracker.on_choose(_choice(1, 0, [5], [[0], [0]]))
        tracker.on_step_end(1)
    seen = tracker.locality(1, 10)
    assert seen[3] == BlockLocality(1.0, 3, 3, 0.25) and seen[7] == BlockLocality(0.0, 3, 3, 0.25)
    assert 5 not in seen  # chosen every time, as the only candidate: no more than chance
    tracker.forget(1)
    assert tracker.locality(1, 10) == {}


def _cited(seq: SyntheticSequence, block: int, start: int, block_size: int = 8) -> None:
    """Every query from `start` on points at the keys of `block` (a conversation citing it)."""
    # [layers, kv_heads, D]
    keys = seq.k[:, block * block_size : (block + 1) * block_size].mean(dim=1)
    group = seq.heads // seq.kv_heads
    seq.q[:, start:] = 4 * keys.repeat_interleave(group, dim=1)[:, None]


@pytest.fixture
def make_cache(tmp_path):
    caches = []

    def make(**settings) -> TieredKVCache:
        cache = TieredKVCache(tiny_config(cold_zone_dir=str(tmp_path / str(len(caches))), **SPARSE,
                                          **settings))
        caches.append(cache)
        return cache

    yield make
    for cache in caches:
        cache.close()


def _cited_run(cache: TieredKVCache, steps_end: int = 100) -> float:
    """Prefill 64 tokens (8 blocks: block 2 on the disk level by age), decode to `steps_end` with
    every query citing block 2; the mean error of the last step's attention against exact."""
    seq = SyntheticSequence(1, steps_end + 1, seed=3)
    _cited(seq, block=2, start=64)
    cache.add_sequence(1)
    seq.forward(cache, 0, 64)
    assert set(cache.blocks.tables[1].blocks[2].slots) == {Level.DISK}
    for t in range(64, steps_end):
        seq.forward(cache, t, t + 1)
    out = seq.forward(cache, steps_end, steps_end + 1)
    return (out.double() - seq.reference(steps_end, steps_end + 1)).abs().mean().item()


def test_a_block_every_choice_picks_gets_an_l0_copy_and_its_l1_copy_back(make_cache):
    cache = make_cache(**LOCALITY)
    assert isinstance(cache.policy, LocalityPolicy) and cache.policy.device_blocks == 2
    error = _cited_run(cache)
    block = cache.blocks.tables[1].blocks[2]
    assert Level.DEVICE in block.slots and Level.HOST in block.slots
    assert cache.kv_stats().locality.locality_raised_to_device >= 1
    fp = cache.policy.footprint(101)
    held = cache.blocks.tables[1].copies_on
    assert all(len(held(level)) <= fp.on(level) for level in cache.levels)
    # The age rule leaves the block on the disk level; reading it from L0 instead frees L2's
    # selection for another block: attention is no further from exact.
    age = make_cache()
    assert age.locality is None and age.kv_stats().locality is None
    age_error = _cited_run(age)
    assert set(age.blocks.tables[1].blocks[2].slots) == {Level.DISK}
    assert error <= age_error * 1.05, (error, age_error)


class _Measured:
    """A tracker whose ALIs the test states (what the policy and placement do with them)."""

    def __init__(self, seen: dict[int, BlockLocality]) -> None:
        self.seen = seen

    def locality(self, seq_id: int, num_blocks: int) -> dict[int, BlockLocality]:
        return {i: s for i, s in self.seen.items() if i < num_blocks}

    def forget(self, seq_id: int) -> None:
        pass


def test_a_block_never_chosen_leaves_l1_early_and_nothing_moves_on_a_saturated_link(make_cache):
    cache = make_cache(**LOCALITY)
    seq = SyntheticSequence(1, 80, seed=4)
    cache.add_sequence(1)
    seq.forward(cache, 0, 48)  # 6 blocks: 0 the sink, 1 on disk, 2-3 in L1 by age, 4-5 the window
    never = BlockLocality(0.0, 4, 4)
    cache.locality.tracker = _Measured({2: never, 3: never})
    cache.locality.link.utilization = 0.0
    seq.forward(cache, 48, 56)  # a block fills: roles are made again
    table = cache.blocks.tables[1]
    assert set(table.blocks[2].slots) == {Level.DISK}  # sunk: it would stay in L1 by age
    assert cache.kv_stats().locality.locality_sunk >= 1
    # Saturated: a cited block is not raised (and none sinks).
    cache.locality.tracker = _Measured({1: BlockLocality(1.0, 4, 4)})
    cache.locality.link.observe = lambda moved: 1.0
    cache.locality.link.utilization = 1.0
    seq.forward(cache, 56, 64)
    assert set(table.blocks[1].slots) == {Level.DISK}
    assert cache.kv_stats().locality.locality_deferred >= 1


def test_the_link_rate_is_measured_and_its_use_follows_the_bytes_moved(monkeypatch):
    link = LinkMonitor(torch.device("cpu"))
    assert link.link_bytes_per_s > 1e8  # a memory copy: well over 100 MB/s
    clock = iter([0.0, 1.0, 2.0])
    monkeypatch.setattr(locality_module.time, "perf_counter", lambda: next(clock))
    link.link_bytes_per_s = 1000.0
    link.observe(0)
    assert link.observe(900) == pytest.approx(0.9) and link.saturated
    assert link.observe(1000) == pytest.approx(0.1) and not link.saturated
