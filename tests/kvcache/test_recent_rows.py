"""The newest tokens kept FP16 in each sequence's row (RecentRows), alone and inside the tiered cache."""

from __future__ import annotations

import pytest
import torch

from flashmemory.kvcache.recent_rows import RecentRows, recent_capacity
from flashmemory.kvcache.sequence_state import SequenceKV
from flashmemory.kvcache.tiered import TieredKVCache
from tests.kvcache.synthetic import SyntheticSequence, tiny_config
from tests.kvcache.test_tiered_synthetic import _forward_with_tokens

LAYERS, HEADS, BS, DIM = 2, 3, 4, 5


@pytest.mark.parametrize("recent, sink", [(0, 0), (3, 0), (8, 4), (12, 8), (12, 0)])
def test_a_row_keeps_the_sinks_and_newest_tokens_and_hands_out_every_full_block_once_in_order(recent, sink):
    cap = recent_capacity(recent, BS, active_window=1000)
    rows = RecentRows(2, LAYERS, HEADS, BS, DIM, cap, sink, torch.device("cpu"))
    seq = SequenceKV(filling_row=rows.take())
    g = torch.Generator().manual_seed(recent)
    stream_k, stream_v, written = [], [], []
    for n in (1, 1, 6, 1, 9, 1, 1, 1, 1, 13, 2, 1):  # prefill chunks and decode steps
        k, v = torch.randn(2, LAYERS, HEADS, n, DIM, generator=g).half()
        stream_k.append(k)
        stream_v.append(v)
        blocks_before = sum(w.shape[2] for w in written) // BS
        done = rows.append(seq, k, v, blocks_before)
        written.append(done.full_k)
        assert done.full_v.shape == done.full_k.shape and done.full_k.shape[2] == done.num_blocks * BS
        all_k, all_v = torch.cat(stream_k, dim=2), torch.cat(stream_v, dim=2)
        total = all_k.shape[2]
        full = total // BS * BS
        assert seq.num_sink == min(sink, full)
        assert seq.num_recent == min(cap, full - seq.num_sink)
        assert seq.num_filling == seq.num_sink + seq.num_recent + total % BS
        tail = seq.num_filling - seq.num_sink  # the recent blocks and the filling block: the newest tokens
        for layer in range(LAYERS):
            view = rows.layer_view(seq, layer)
            for i, stream in enumerate((all_k, all_v)):
                assert torch.equal(view[i], torch.cat((stream[layer, :, : seq.num_sink],
                                                       stream[layer, :, total - tail :]), dim=1))
    blocks = torch.cat(written, dim=2)
    assert torch.equal(blocks, all_k[:, :, : total // BS * BS])  # every full block once, oldest first


def test_rows_are_counted_and_run_out_with_a_clear_error():
    rows = RecentRows(1, LAYERS, HEADS, BS, DIM, recent_capacity(8, BS, 16), BS, torch.device("cpu"))
    assert rows.row_bytes == 2 * LAYERS * HEADS * (BS + 8 + BS) * DIM * 2 == rows.nbytes
    rows.take()
    with pytest.raises(Exception, match="max_num_seqs"):
        rows.take()


def test_the_row_keeps_at_most_the_windows_blocks():
    assert recent_capacity(100, 16, 2048) == 112 and recent_capacity(128, 16, 40) == 32
    assert recent_capacity(0, 16, 2048) == 0


def _decode_error(recent: int, tmp_path, window: int = 16) -> float:
    # L0 INT4 (the window, the sink block), L1 FP16 (everything older): only the L0 copies are lossy.
    cache = TieredKVCache(tiny_config(kv_precision="int4", selection="exact", cold_zone_enabled=False,
                                      warm_tokens=10_000, recent_fp16_tokens=recent, active_window=window,
                                      cold_zone_dir=str(tmp_path)))
    seq = SyntheticSequence(0, 90, seed=5)
    cache.add_sequence(0)
    seq.forward(cache, 0, 50)
    decoded = torch.cat([seq.forward(cache, t, t + 1) for t in range(50, 90)], dim=1).double()
    cache.close()
    reference = seq.reference(50, 90)
    return ((decoded - reference).norm() / reference.norm()).item()


def test_the_sink_and_recent_tokens_are_attended_in_fp16_instead_of_their_int4_copies(tmp_path):
    lossy = _decode_error(0, tmp_path)
    assert lossy > 1e-3  # the INT4 window and sink are in the answer
    assert 1e-5 < _decode_error(8, tmp_path) < lossy  # the sink and the window's newest block read FP16
    assert _decode_error(16, tmp_path) < 1e-5  # the sink and the whole 16-token window: exact up to fp16 storage
    assert _decode_error(96, tmp_path) < 1e-5  # (at most the window's blocks are kept)


def test_recent_blocks_still_reach_every_level_and_the_prefix_cache(tmp_path):
    cache = TieredKVCache(tiny_config(kv_precision="mixed", recent_fp16_tokens=16, cold_zone_dir=str(tmp_path)))
    seq = SyntheticSequence(0, 60, seed=1)
    cache.add_sequence(0)
    batch_tokens = list(range(1000, 1060))
    _forward_with_tokens(seq, cache, batch_tokens, 0, 60)
    assert len(cache.blocks.tables[0].blocks) == 60 // 8  # full blocks written although the last two are in the row
    row = cache.seqs[0]
    assert (row.num_sink, row.num_recent, row.num_filling) == (8, 16, 8 + 16 + 60 % 8)  # sink block, 2 recent
    cache.free_sequence(0)
    cache.add_sequence(1)
    assert cache.reuse_prefix(1, batch_tokens) == 56  # prefilled blocks are reusable, row or not
    row_bytes = 2 * 2 * 2 * (8 + 16 + 8) * 16 * 2
    rows = cache.cfg.max_num_seqs  # one row per sequence alive at once
    assert cache.device_bytes_capacity() >= cache.rows.nbytes == rows * row_bytes
    cache.close()


def test_a_reused_prefix_leaves_the_row_as_a_fresh_prefill_would(tmp_path):
    tokens = list(range(500, 560))
    outputs = []
    for reuse in (False, True):
        # warm_tokens 64: no block of the 48-token prefix ages into INT2 L2, where a prefix could not be reused
        cache = TieredKVCache(tiny_config(kv_precision="mixed", recent_fp16_tokens=16, warm_tokens=64,
                                          cold_zone_dir=str(tmp_path / str(reuse))))
        seq = SyntheticSequence(1, 60, seed=7)
        start = 0
        if reuse:  # an earlier request left the first 48 tokens' blocks in the prefix cache
            cache.add_sequence(0)
            _forward_with_tokens(SyntheticSequence(0, 60, seed=7), cache, tokens, 0, 48)
            cache.free_sequence(0)
            cache.add_sequence(1)
            start = cache.reuse_prefix(1, tokens[:48])
            assert start == 40 and cache.seqs[1].num_recent == 16
        else:
            cache.add_sequence(1)
        _forward_with_tokens(seq, cache, tokens, start, 48)
        outputs.append(torch.cat([_forward_with_tokens(seq, cache, tokens, t, t + 1) for t in range(48, 60)], dim=1))
        cache.close()
    assert torch.allclose(outputs[0], outputs[1], atol=1e-6, rtol=0)
