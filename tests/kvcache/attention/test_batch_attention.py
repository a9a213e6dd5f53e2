"""The batch attention seam: a forward's decode tokens reach the backend in one call per layer (a
DecodeBatch) and get what each sequence alone would; Quest scores the whole batch with one transfer
each way per layer; a read that fails for one sequence is blamed on it."""

from __future__ import annotations

import pytest
import torch

from flashmemory.kvcache.interface import ForwardBatch
from flashmemory.kvcache.manager.blocks import Level
from flashmemory.kvcache.read.reader import BlockReader
from flashmemory.kvcache.tiered import TieredKVCache
from tests.kvcache.synthetic import LAYERS, SyntheticSequence, skip_without_native, tiny_config

# No old block; L1 only; L1 and L2; a long one (an L1 of 8 blocks: two kernel lanes at 3 threads)
LENGTHS = (10, 45, 95, 140)
STEPS = 6


def _cache(path, backend: str, selection: str) -> TieredKVCache:
    cache = TieredKVCache(tiny_config(cold_zone_dir=str(path), selection=selection, warm_tokens=64,
                                      warm_budget_tokens=16, selection_min_tokens=0,
                                      semantic_truncate_threshold=0.5, max_num_seqs=5))
    skip_without_native(cache, backend)
    cache.use_attention_backend(backend)
    return cache


def _forward(cache: TieredKVCache, items: list[tuple[SyntheticSequence, int, int]]
             ) -> torch.Tensor:
    """One forward of tokens [start, end) of each sequence, flattened in order; the outputs
    [layers, T, heads, D]."""
    batch = ForwardBatch.build([(s.seq_id, a, b - a) for s, a, b in items], torch.device("cpu"))
    outs = []
    for layer in range(LAYERS):
        q, k, v = (torch.cat([getattr(s, name)[layer, a:b] for s, a, b in items])
                   for name in "qkv")
        outs.append(cache.attend(layer, batch, q, k, v))
    cache.commit(batch)
    return torch.stack(outs)


@pytest.fixture
def three_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("selection", ["quest", "exact"])
@pytest.mark.parametrize("backend", ["native", "torch"])
def test_batch_attention_matches_per_sequence_attention(backend, selection, tmp_path,
                                                        three_threads):
    batched = _cache(tmp_path / "batched", backend, selection)
    alone = _cache(tmp_path / "alone", backend, selection)
    seqs = [SyntheticSequence(i, n + STEPS, seed=i) for i, n in enumerate(LENGTHS)]
    late = SyntheticSequence(9, 30 + STEPS, seed=9)  # its prefill chunk rides with the decodes
    for cache in (batched, alone):
        for s, n in zip(seqs, LENGTHS):
            cache.add_sequence(s.seq_id)
            _forward(cache, [(s, 0, n)])
    calls = []
    inner = batched.attention.decode_batch
    batched.attention.decode_batch = (
        lambda batch, reader: calls.append(len(batch.seqs)) or inner(batch, reader))
    for t in range(STEPS):
        items = [(s, n + t, n + t + 1) for s, n in zip(seqs, LENGTHS)]
        if t == 2:
            for cache in (batched, alone):
                cache.add_sequence(late.seq_id)
            items.insert(1, (late, 0, 30))
        elif t > 2:
            items.insert(1, (late, 30 + t - 3, 31 + t - 3))
        together = _forward(batched, items)
        one_by_one = torch.cat([_forward(alone, [item]) for item in items], dim=1)
        if backend == "native":
            assert torch.equal(together, one_by_one), f"step {t}"
        else:  # the torch backend pads the batch into one masked attention: float rounding apart
            torch.testing.assert_close(together, one_by_one, rtol=1e-6, atol=1e-6)
    # steps 0-2: the four decodes (step 2's prefill chunk goes alone); then the late one joins them
    assert calls == [len(LENGTHS)] * (3 * LAYERS) + [len(LENGTHS) + 1] * ((STEPS - 3) * LAYERS)
    stats = batched.stats()
    assert stats["bytes_moved_L1->L2"] > 0  # the batches read all three levels
    if selection == "quest":
        assert 0 < stats["L1_selected_fraction"] < 1 and 0 < stats["L2_selected_fraction"] < 1
    batched.close()
    alone.close()


def _prefilled(cache) -> list[SyntheticSequence]:
    """One sequence per entry of LENGTHS, its prompt prefilled alone."""
    seqs = [SyntheticSequence(i, n + 1, seed=i) for i, n in enumerate(LENGTHS)]
    for s, n in zip(seqs, LENGTHS):
        cache.add_sequence(s.seq_id)
        _forward(cache, [(s, 0, n)])
    return seqs


def test_quest_scoring_is_one_transfer_per_layer(tmp_path):
    cache = _cache(tmp_path, "torch", "quest")
    seqs = _prefilled(cache)
    old_levels = sum(level != Level.DEVICE for s in seqs
                     for level in cache.reader.plan(s.seq_id, cache.seqs[s.seq_id], True, True))
    transfers, choices = [], []
    transfer, choose = cache.reader.transfer, cache.reader._choose
    cache.reader.transfer = (
        lambda tensors, device: transfers.append(len(tensors)) or transfer(tensors, device))
    cache.reader._choose = lambda *args: choices.append(args[0]) or choose(*args)
    _forward(cache, [(s, n, n + 1) for s, n in zip(seqs, LENGTHS)])
    # three sequences with old blocks (the longest on L1 and L2): each scored at every layer, with
    # the queries in one transfer and the choices in one
    assert old_levels == 4 and len(choices) == old_levels * LAYERS
    assert transfers == [1, old_levels] * LAYERS
    cache.close()


def test_a_batch_moves_its_choices_to_another_device_in_one_copy():
    chosen = [torch.arange(6).view(2, 3), torch.arange(4).view(2, 2) + 10]
    moved = BlockReader.transfer(chosen, torch.device("meta"))
    assert [(t.device.type, t.shape) for t in moved] == [("meta", (2, 3)), ("meta", (2, 2))]
    assert BlockReader.transfer(chosen, torch.device("cpu")) is chosen  # already there: no copy


def test_a_read_that_fails_in_a_decode_batch_is_blamed_on_its_sequence(tmp_path):
    cache = _cache(tmp_path, "torch", "exact")
    seqs = _prefilled(cache)
    gather = cache.reader.gather

    def failing_gather(level, plan, *args, **kwargs):
        if plan.seq_id == 2:
            raise OSError("the disk went away")
        return gather(level, plan, *args, **kwargs)

    cache.reader.gather = failing_gather
    steps = [(s.seq_id, n, 1) for s, n in zip(seqs, LENGTHS)]
    batch = ForwardBatch.build(steps, torch.device("cpu"))
    q, k, v = (torch.cat([getattr(s, name)[0, n : n + 1] for s, n in zip(seqs, LENGTHS)])
               for name in "qkv")
    with pytest.raises(OSError) as failure:
        cache.attend(0, batch, q, k, v)
    assert failure.value.seq_id == 2
    cache.rollback(batch)
    cache.close()
