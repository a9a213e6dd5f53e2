"""The tiered cache at its own size: synthetic K/V on the tiny model's geometry, no checkpoint loaded."""

from __future__ import annotations

import pytest
import torch

from flashmemory.errors import ConfigError
from flashmemory.kv_settings import MIB
from flashmemory.kvcache.manager.blocks import Level
from flashmemory.kvcache.tiered import TieredKVCache
from tests.kvcache.synthetic import SyntheticSequence, skip_without_native, tiny_config


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_fp16_exact_selection_over_three_levels_equals_dense_attention(backend, tmp_path):
    cache = TieredKVCache(tiny_config(kv_precision="fp16", selection="exact", cold_zone_dir=str(tmp_path)))
    skip_without_native(cache, backend)
    cache.use_attention_backend(backend)
    seq = SyntheticSequence(1, 120)
    cache.add_sequence(1)
    outputs = [seq.forward(cache, a, b) for a, b in ((0, 30), (30, 60), (60, 70))]  # prefill chunks
    outputs += [seq.forward(cache, t, t + 1) for t in range(70, 120)]  # decode steps
    assert (torch.cat(outputs, dim=1).double() - seq.reference(0, 120)).abs().max() <= 1e-4
    stats = cache.stats()
    assert stats["bytes_moved_L0->L1"] > 0 and stats["bytes_moved_L1->L2"] > 0  # every level was read
    cache.close()


@pytest.mark.parametrize("cold_zone", [True, False])
def test_each_level_holds_exactly_the_policys_footprint_at_every_length(cold_zone, tmp_path):
    cache = TieredKVCache(tiny_config(cold_zone_enabled=cold_zone, warm_tokens=24, cold_zone_dir=str(tmp_path)))
    capacity = cache.kv_capacity()
    seq = SyntheticSequence(0, 130)
    cache.add_sequence(0)
    seq.forward(cache, 0, 27)
    seen = set()
    for t in range(27, 130):
        fp = capacity.footprint(cache.num_tokens(0))
        held = {level: a.num_used for level, a in cache.blocks.allocators.items()}
        assert (held[Level.DEVICE], held[Level.HOST], held.get(Level.DISK, 0)) == (
            fp.device_blocks, fp.host_blocks, fp.disk_blocks), f"at {t} tokens"
        seen.add((fp.device_blocks, fp.host_blocks, fp.disk_blocks))
        seq.forward(cache, t, t + 1)
    assert len(seen) > 5  # the lengths crossed the window, the warm span and (with a cold zone) into L2
    cache.close()


def test_pinned_span_is_counted_by_the_footprint_and_held_on_the_device(tmp_path):
    cache = TieredKVCache(tiny_config(cold_zone_dir=str(tmp_path)))
    seq = SyntheticSequence(0, 100)
    cache.add_sequence(0)
    cache.pin_span(0, 8, 24)
    seq.forward(cache, 0, 100)
    fp = cache.kv_capacity().footprint(100, [(8, 24)])
    assert cache.blocks.allocators[Level.DEVICE].num_used == fp.device_blocks == 2 + 3  # window + sink + 2 pinned
    cache.close()


def test_quantized_levels_stay_close_and_selection_reads_a_fraction(tmp_path):
    errors, fractions = {}, {}
    for selection in ("exact", "quest"):
        cache = TieredKVCache(tiny_config(cold_zone_dir=str(tmp_path), semantic_truncate_threshold=0.5,
                                          warm_budget_tokens=8, selection_min_tokens=0,
                                          selection=selection))
        seq = SyntheticSequence(0, 120, seed=2)
        cache.add_sequence(0)
        seq.forward(cache, 0, 70)
        decoded = torch.cat([seq.forward(cache, t, t + 1) for t in range(70, 120)], dim=1).double()
        reference = seq.reference(70, 120)
        errors[selection] = ((decoded - reference).norm() / reference.norm()).item()
        stats = cache.stats()
        fractions[selection] = (stats["L1_selected_fraction"], stats["L2_selected_fraction"])
        cache.close()
    # INT4 L0 / INT2 L2 on random (not low-rank) keys: bounded, not small; reading half the cold blocks costs more.
    assert errors["exact"] < 0.4 and errors["exact"] < errors["quest"]
    assert fractions["exact"] == (0.0, 0.0)  # nothing selected: every block read
    assert 0 < fractions["quest"][1] < 1 and 0 < fractions["quest"][0] <= 1


def test_boxes_in_the_digest_select_through_the_whole_cache_and_report_their_memory(tmp_path):
    stats = {}
    for box in (0, 4):
        cache = TieredKVCache(tiny_config(cold_zone_dir=str(tmp_path / str(box)), semantic_truncate_threshold=0.5,
                                          warm_budget_tokens=8, selection_min_tokens=0, selection_box_tokens=box))
        seq = SyntheticSequence(0, 90, seed=3)
        cache.add_sequence(0)
        seq.forward(cache, 0, 70)
        decoded = torch.cat([seq.forward(cache, t, t + 1) for t in range(70, 90)], dim=1).double()
        assert torch.isfinite(decoded).all()
        stats[box] = cache.stats()
        cache.close()
    assert stats[4]["selection_digest_bytes_per_token"] == 2 * stats[0]["selection_digest_bytes_per_token"]
    assert stats[4]["selection_digest_bytes"] == 2 * stats[0]["selection_digest_bytes"]
    assert 0 < stats[4]["L2_selected_fraction"] < 1


def test_a_box_that_does_not_divide_the_block_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match="selection_box_tokens=3 does not divide block_size=8"):
        TieredKVCache(tiny_config(selection_box_tokens=3))


def test_memory_and_disk_the_os_commits_stay_at_the_working_set(tmp_path):
    cache = TieredKVCache(tiny_config(cold_zone_dir=str(tmp_path), host_slots=4096, disk_slots=4096))
    committed = []
    for i in range(30):  # one request after another: each grows into L2, then is freed
        seq = SyntheticSequence(i, 80, seed=i)
        cache.add_sequence(i)
        seq.forward(cache, 0, 80)
        stats = cache.stats()
        committed.append((stats["L1_bytes_committed"], stats["L2_bytes_committed"]))
        cache.free_sequence(i)
    assert committed[-1] == committed[0]  # slots are reused most-recently-freed first: no creep over the pool
    cache.close()


def _forward_with_tokens(seq: SyntheticSequence, cache, tokens: list[int], start: int, end: int):
    """SyntheticSequence.forward, with the token ids the cache names full blocks by."""
    from flashmemory.kvcache.interface import ForwardBatch

    batch = ForwardBatch.build([(seq.seq_id, start, end - start, tokens[start:end])], torch.device("cpu"))
    out = torch.stack([cache.attend(layer, batch, seq.q[layer, start:end], seq.k[layer, start:end],
                                    seq.v[layer, start:end]) for layer in range(seq.q.shape[0])])
    cache.commit(batch)
    return out


def test_a_cached_prefix_is_reused_and_reads_exactly_what_a_fresh_prefill_wrote(tmp_path):
    cache = TieredKVCache(tiny_config(kv_precision="fp16", selection="exact", cold_zone_dir=str(tmp_path)))
    tokens = list(range(100, 190))
    first, second = SyntheticSequence(1, 90, seed=5), SyntheticSequence(2, 90, seed=5)  # the same K/V per token
    cache.add_sequence(1)
    _forward_with_tokens(first, cache, tokens, 0, 60)
    reference = torch.cat([_forward_with_tokens(first, cache, tokens, t, t + 1) for t in range(60, 90)], dim=1)
    cache.free_sequence(1)
    assert cache.stats()["prefix_cache_blocks"] == 90 // 8  # its full blocks stay cached
    cache.add_sequence(2)
    reused = cache.reuse_prefix(2, tokens[:60])
    assert reused == 56 and cache.num_tokens(2) == 56  # 7 full blocks of 60 tokens; the rest is prefilled
    _forward_with_tokens(second, cache, tokens, 56, 60)
    again = torch.cat([_forward_with_tokens(second, cache, tokens, t, t + 1) for t in range(60, 90)], dim=1)
    assert torch.equal(again, reference)
    stats = cache.stats()
    assert stats["prefix_cache_hits"] == 56 and stats["prefix_cache_queries"] == 60
    cache.close()


def test_cached_blocks_give_way_to_live_ones_and_move_to_disk_first(tmp_path):
    cache = TieredKVCache(tiny_config(cold_zone_dir=str(tmp_path), host_slots=12, device_slots=16))
    cache.add_sequence(1)
    _forward_with_tokens(SyntheticSequence(1, 96), cache, list(range(96)), 0, 96)  # 12 blocks: L1 is full
    cache.free_sequence(1)
    cache.add_sequence(2)
    _forward_with_tokens(SyntheticSequence(2, 64, seed=1), cache, list(range(500, 564)), 0, 64)
    stats = cache.stats()
    assert stats["L1_prefix_evicted_blocks"] > 0 and stats["prefix_cache_blocks"] > 8  # kept, on disk
    assert len(cache.prefix_cache.match(list(range(97)), count=False)) == 12  # every block is still cached
    cache.add_sequence(3)
    # The newest gave their L1 copies up (the tail goes first): they are computed again, not read at
    # INT4. Computing them reads the 4 blocks before them in FP16 (window + warm tokens), so the
    # prefix ends 4 blocks earlier. The blocks that aged into L2 while the sequence was live kept
    # their FP16 masters for the cache.
    assert cache.reuse_prefix(3, list(range(97))) == 32
    assert cache.stats()["prefix_cache_lossy_refusals"] == 1
    cache.close()


def test_unused_cached_blocks_keep_host_memory_within_their_budget_and_wait_on_disk(tmp_path):
    slot = TieredKVCache(tiny_config(cold_zone_dir=str(tmp_path / "probe"))).host_pool.bytes_per_slot
    cache = TieredKVCache(tiny_config(cold_zone_dir=str(tmp_path),
                                      prefix_cache_host_mb=3 * slot / MIB))
    for i in range(4):
        cache.add_sequence(i)
        _forward_with_tokens(SyntheticSequence(i, 48, seed=i), cache, list(range(1000 * i, 1000 * i + 48)), 0, 48)
        cache.free_sequence(i)
        stats = cache.stats()
        assert stats["L1_cached_blocks"] <= 3  # the budget holds after every request
    assert stats["L2_cached_blocks"] > 0  # the rest wait on disk, still cached
    assert len(cache.prefix_cache.match(list(range(0, 49)), count=False)) == 6
    # The first request's blocks all gave their L1 copy up for INT4 ones, and a fresh 48-token
    # prompt keeps its sink and newest blocks in L1: none is reused (reading them at INT4 is what a
    # fresh run would not do). The last request's tail went first: its first 3 blocks keep their
    # FP16 masters (the budget), block 1 included, which aged into L2 while the sequence was live.
    cache.add_sequence(9)
    assert cache.reuse_prefix(9, list(range(0, 49))) == 0
    cache.add_sequence(10)
    assert cache.reuse_prefix(10, list(range(3000, 3049))) == 24
    cache.close()


@pytest.mark.parametrize("precision", ["mixed", "fp16"])
def test_blocks_holding_approximately_decoded_tokens_are_not_offered_for_reuse(precision, tmp_path):
    # A decode step reads the INT4 window copy and selects blocks; a prefill reads FP16: the KV of a token decoded
    # with mixed precision differs from the KV a prefill of the same tokens computes, so its block is not reused.
    selection = "quest" if precision == "mixed" else "exact"
    cache = TieredKVCache(tiny_config(kv_precision=precision, selection=selection, cold_zone_dir=str(tmp_path)))
    tokens = list(range(100, 160))
    seq = SyntheticSequence(1, 60, seed=3)
    cache.add_sequence(1)
    _forward_with_tokens(seq, cache, tokens, 0, 20)  # prefill: 2 full blocks and 4 tokens filling the third
    for t in range(20, 60):  # decode: the third block mixes prefilled and decoded tokens
        _forward_with_tokens(seq, cache, tokens, t, t + 1)
    cache.free_sequence(1)
    reusable = 60 // 8 if precision == "fp16" else 2  # exact decode: every full block; approximate: the prefilled
    assert cache.stats()["prefix_cache_blocks"] == reusable
    cache.add_sequence(2)
    # Mixed: block 1 aged into L2 while the sequence was live; its FP16 master was kept for the
    # cache, so both prefilled blocks are reused.
    assert cache.reuse_prefix(2, tokens) == reusable * 8
    cache.close()


def test_unused_cached_blocks_keep_disk_within_their_budget_and_the_oldest_leave(tmp_path):
    probe = TieredKVCache(tiny_config(cold_zone_dir=str(tmp_path / "probe")))
    host_slot, disk_slot = probe.host_pool.bytes_per_slot, probe.disk_pool.bytes_per_slot
    probe.close()
    cache = TieredKVCache(tiny_config(cold_zone_dir=str(tmp_path), prefix_cache_host_mb=0,
                                      prefix_cache_disk_mb=8 * disk_slot / MIB))
    for i in range(5):  # 6 full blocks each: 30 in all, 8 may stay
        cache.add_sequence(i)
        _forward_with_tokens(SyntheticSequence(i, 48, seed=i), cache, list(range(1000 * i, 1000 * i + 48)), 0, 48)
        cache.free_sequence(i)
        stats = cache.stats()
        assert stats["L1_cached_blocks"] == 0 and stats["L2_cached_blocks"] <= 8
    assert stats["L2_cached_blocks"] == 8  # full: the least recently used went first
    assert len(cache.prefix_cache.match(list(range(4000, 4049)), count=False)) == 6  # the newest is still there
    assert cache.prefix_cache.match(list(range(0, 49)), count=False) == []  # the oldest left the cache
    cache.close()


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_the_32k_models_geometry_is_exact_over_three_levels_with_its_auto_block_size(backend, tmp_path):
    from flashmemory.config import EngineConfig
    from tests.kvcache.synthetic import QWEN_GEOMETRY

    block = EngineConfig(block_size="auto").resolve_block_size(32768)
    assert block == 32
    g = QWEN_GEOMETRY
    cache = TieredKVCache(tiny_config(num_layers=g["layers"], num_kv_heads=g["kv_heads"], head_dim=g["dim"],
                                      block_size=block, active_window=64, warm_tokens=64, kv_precision="fp16",
                                      selection="exact", cold_zone_dir=str(tmp_path)))
    skip_without_native(cache, backend)
    cache.use_attention_backend(backend)  # 7 query heads per KV head
    seq = SyntheticSequence(1, 300, seed=3, **g)
    cache.add_sequence(1)
    outputs = [seq.forward(cache, 0, 200)] + [seq.forward(cache, t, t + 1) for t in range(200, 300)]
    assert (torch.cat(outputs, dim=1).double() - seq.reference(0, 300)).abs().max() <= 1e-4
    assert cache.stats()["bytes_moved_L1->L2"] > 0
    cache.close()


def test_masters_kept_for_the_cache_give_way_when_live_blocks_need_l1(tmp_path):
    # Window 2 blocks, L1 2 blocks: of 10 full blocks, 5 age into L2 while the sequence is live and
    # keep their L1 masters for the cache, beside the 5 L1 copies it reads (sink, window, warm). A
    # second sequence's 8 new blocks take 2 of those slots back.
    cache = TieredKVCache(tiny_config(cold_zone_dir=str(tmp_path), host_slots=16))
    cache.add_sequence(1)
    first = SyntheticSequence(1, 81)
    for start in range(0, 81, 16):  # chunks of 2 blocks: each commit moves the oldest down
        _forward_with_tokens(first, cache, list(range(81)), start, min(start + 16, 81))
    kept = list(cache.blocks.kept_masters.values())
    # the sequence reads their L2 copies
    assert len(kept) == 5 and all(Level.HOST not in b.slots for b in kept)
    # free for the taking, as unused cached blocks are
    assert cache.kv_stats().level("L1").cached_blocks == 5
    cache.add_sequence(2)
    _forward_with_tokens(SyntheticSequence(2, 64, seed=1), cache, list(range(500, 564)), 0, 64)
    lost = [b.master_lost for b in kept]
    assert any(lost) and lost == sorted(lost, reverse=True)  # some gave way, the oldest first
    assert all(b.kept_master_slot is None for b, gone in zip(kept, lost) if gone)
    cache.free_sequence(1)
    cache.free_sequence(2)
    assert not cache.blocks.kept_masters
    held = sum(len(b.slots) for b in cache.prefix_cache.index.values())
    assert held == sum(a.num_used for a in cache.blocks.allocators.values())  # no slot leaked
    cache.close()


def test_a_prefix_shared_with_a_live_sequence_is_digested_from_its_kept_master(tmp_path):
    # Sequence 1 reads L2 copies of its oldest blocks and keeps their FP16 masters; sequence 2
    # reuses the same prefix while 1 is live: its digests are the FP16 keys' (as 1's were when
    # written), not the INT4 copies'.
    cache = TieredKVCache(tiny_config(cold_zone_dir=str(tmp_path)))
    cache.add_sequence(1)
    first = SyntheticSequence(1, 81)
    for start in range(0, 81, 16):
        _forward_with_tokens(first, cache, list(range(81)), start, min(start + 16, 81))
    assert cache.blocks.kept_masters
    cache.add_sequence(2)
    assert cache.reuse_prefix(2, list(range(81))) == 80
    n = len(cache.blocks.tables[1].blocks)
    mine, shared = cache.seqs[1].digest[:, :, :n], cache.seqs[2].digest[:, :, :n]
    assert torch.equal(mine, shared)
    cache.close()
