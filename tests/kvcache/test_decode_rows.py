"""A forward whose new tokens are read as decode steps (`as_decode`, a speculative verification):
within the filling block, each token's attention is exactly what the decode step at its position
computes, on every level and with selection; and a draft cache forgets committed tokens there."""

from __future__ import annotations

import pytest
import torch

from flashmemory.kvcache.contiguous import ContiguousKVCache
from flashmemory.kvcache.interface import ForwardBatch
from flashmemory.kvcache.manager.blocks import Level
from flashmemory.kvcache.tiered import TieredKVCache
from tests.kvcache.synthetic import (DIM, KV_HEADS, LAYERS, SyntheticSequence, skip_without_native,
                                     tiny_config)

PROMPT = 75  # 9 full 8-token blocks (some on L2 with the tiny geometry) and 3 filling tokens


def _forward(seq: SyntheticSequence, cache, start: int, end: int, as_decode: bool = False,
             kept: int | None = None) -> torch.Tensor:
    batch = ForwardBatch.build([(seq.seq_id, start, end - start)], torch.device("cpu"),
                               as_decode={seq.seq_id} if as_decode else ())
    out = torch.stack([cache.attend(layer, batch, seq.q[layer, start:end], seq.k[layer, start:end],
                                    seq.v[layer, start:end]) for layer in range(seq.layers)])
    cache.commit(batch, None if kept is None else {seq.seq_id: kept})
    return out


def _steps(seq: SyntheticSequence, cache, start: int, end: int) -> torch.Tensor:
    """Tokens [start, end) one decode step each."""
    return torch.cat([_forward(seq, cache, t, t + 1) for t in range(start, end)], dim=1)


def _cache(kind: str, tmp_path, backend: str = "torch", **settings):
    if kind == "contiguous":
        return ContiguousKVCache(LAYERS, KV_HEADS, DIM, torch.float32, torch.device("cpu"), 256)
    cache = TieredKVCache(tiny_config(cold_zone_dir=str(tmp_path), **settings))
    cache.use_attention_backend(backend)
    skip_without_native(cache, backend)
    return cache


def _prefilled(kind: str, tmp_path, seq: SyntheticSequence, backend: str = "torch", **settings):
    cache = _cache(kind, tmp_path, backend, **settings)
    cache.add_sequence(seq.seq_id)
    _forward(seq, cache, 0, PROMPT)
    return cache


# Budgets that leave half of L1 and most of L2 unread, so each token's own choice is under test.
SPARSE = dict(selection_min_tokens=1, warm_budget_tokens=8, semantic_truncate_threshold=0.2)


@pytest.mark.parametrize("settings", [SPARSE, {**SPARSE, "kv_precision": "int2-disk"},
                                      {"selection": "exact"}],
                         ids=["sparse", "int2-disk", "exact-reads"])
@pytest.mark.parametrize("backend", ["torch", "native"])
def test_tokens_read_as_decode_steps_equal_those_steps_within_the_filling_block(settings, backend,
                                                                               tmp_path):
    seq = SyntheticSequence(1, 100, seed=4)
    steps = _prefilled("tiered", tmp_path / "a", seq, backend, **settings)
    rows = _prefilled("tiered", tmp_path / "b", seq, backend, **settings)
    assert rows.max_decode_rows(1) == 8 - PROMPT % 8 == 5
    assert rows.blocks.allocators[Level.DISK].num_used > 0  # the L2 reads are under test too
    sequential = _steps(seq, steps, PROMPT, PROMPT + 5)
    verified = _forward(seq, rows, PROMPT, PROMPT + 5, as_decode=True)
    if "selection" not in settings:  # five steps' choices, each a part of the old blocks
        assert rows.reader.selection_steps == steps.reader.selection_steps == 5
        chosen = rows.reader.selected_blocks
        assert chosen == steps.reader.selected_blocks != rows.reader.candidate_blocks
    if backend == "native":  # one kernel call per token whatever the batch: the same bits
        assert torch.equal(verified, sequential)
    else:  # torch's masked batch call rounds otherwise than its one-sequence call (any batch)
        torch.testing.assert_close(verified, sequential, rtol=1e-6, atol=1e-6)
    # and both caches go on alike (the same KV, the same choices)
    for t in range(PROMPT + 5, 96):
        assert torch.equal(_forward(seq, rows, t, t + 1), _forward(seq, steps, t, t + 1))
    steps.close(), rows.close()


def test_a_prefill_chunk_reads_otherwise_so_the_flag_matters(tmp_path):
    seq = SyntheticSequence(1, 100, seed=4)
    steps = _prefilled("tiered", tmp_path / "a", seq)
    rows = _prefilled("tiered", tmp_path / "b", seq)
    sequential = _steps(seq, steps, PROMPT, PROMPT + 5)
    # a chunk reads the FP16 masters of every block
    assert not torch.equal(_forward(seq, rows, PROMPT, PROMPT + 5), sequential)
    steps.close(), rows.close()


def test_contiguous_tokens_read_as_decode_steps_equal_those_steps(tmp_path):
    seq = SyntheticSequence(1, 100, seed=5)
    steps = _prefilled("contiguous", tmp_path, seq)
    rows = _prefilled("contiguous", tmp_path, seq)
    sequential = _steps(seq, steps, PROMPT, PROMPT + 7)
    assert torch.equal(_forward(seq, rows, PROMPT, PROMPT + 7, as_decode=True), sequential)


@pytest.mark.parametrize("kind", ["tiered", "contiguous"])
def test_a_verification_keeping_some_tokens_goes_on_as_the_steps_would(kind, tmp_path):
    seq = SyntheticSequence(1, 100, seed=6)
    steps = _prefilled(kind, tmp_path / "a", seq)
    rows = _prefilled(kind, tmp_path / "b", seq)
    _forward(seq, rows, PROMPT, PROMPT + 5, as_decode=True, kept=2)
    for t in range(PROMPT, PROMPT + 2):
        _forward(seq, steps, t, t + 1)
    assert rows.num_tokens(1) == steps.num_tokens(1) == PROMPT + 2
    for t in range(PROMPT + 2, 96):
        assert torch.equal(_forward(seq, rows, t, t + 1), _forward(seq, steps, t, t + 1))


@pytest.mark.parametrize("kind", ["tiered", "contiguous"])
def test_truncating_the_filling_block_forgets_those_tokens(kind, tmp_path):
    seq = SyntheticSequence(1, 100, seed=7)
    drafted = _prefilled(kind, tmp_path / "a", seq)
    plain = _prefilled(kind, tmp_path / "b", seq)
    for t in range(PROMPT, PROMPT + 4):  # a draft model's four proposals, each its own decode step
        _forward(seq, drafted, t, t + 1)
    drafted.truncate(1, PROMPT + 1)  # one of them accepted
    _forward(seq, plain, PROMPT, PROMPT + 1)
    assert drafted.num_tokens(1) == plain.num_tokens(1) == PROMPT + 1
    for t in range(PROMPT + 1, 96):
        assert torch.equal(_forward(seq, drafted, t, t + 1), _forward(seq, plain, t, t + 1))


def test_truncating_past_the_filling_block_is_refused(tmp_path):
    seq = SyntheticSequence(1, 100, seed=7)
    cache = _prefilled("tiered", tmp_path, seq)
    with pytest.raises(ValueError, match="only the filling block's 3 can go"):
        cache.truncate(1, PROMPT - 4)
    cache.close()
