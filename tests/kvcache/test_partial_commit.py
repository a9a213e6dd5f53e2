"""A commit that keeps only the first new tokens of a forward (a speculative verification keeps
the accepted draft tokens): the sequence goes on exactly as if the forward had held only those."""

from __future__ import annotations

import pytest
import torch

from flashmemory.kvcache.contiguous import ContiguousKVCache
from flashmemory.kvcache.interface import ForwardBatch
from flashmemory.kvcache.tiered import TieredKVCache
from tests.kvcache.synthetic import DIM, KV_HEADS, LAYERS, SyntheticSequence, tiny_config

TOKENS = list(range(100, 160))


def _forward(seq: SyntheticSequence, cache, start: int, end: int, kept: int | None = None):
    batch = ForwardBatch.build([(seq.seq_id, start, end - start, TOKENS[start:end])],
                               torch.device("cpu"))
    out = torch.stack([cache.attend(layer, batch, seq.q[layer, start:end], seq.k[layer, start:end],
                                    seq.v[layer, start:end]) for layer in range(seq.layers)])
    cache.commit(batch, None if kept is None else {seq.seq_id: kept})
    return out


def _caches(kind: str, tmp_path):
    if kind == "contiguous":
        return [ContiguousKVCache(LAYERS, KV_HEADS, DIM, torch.float32, torch.device("cpu"), 256)
                for _ in range(2)]
    return [TieredKVCache(tiny_config(cold_zone_dir=str(tmp_path / str(i)), kv_precision="fp16",
                                      selection="exact")) for i in range(2)]


@pytest.mark.parametrize("kind", ["tiered", "contiguous"])
@pytest.mark.parametrize("kept", [0, 1, 3])
def test_a_partly_kept_forward_leaves_the_sequence_as_a_shorter_forward_would(kind, kept, tmp_path):
    spec, plain = _caches(kind, tmp_path)
    seq = SyntheticSequence(1, 60, seed=2)
    for cache in (spec, plain):
        cache.add_sequence(1)
        _forward(seq, cache, 0, 37)  # a prompt that ends inside a block
    drafted = _forward(seq, spec, 37, 42, kept=kept)  # 5 rows verified, `kept` accepted
    if kept:
        torch.testing.assert_close(drafted[:, :kept], _forward(seq, plain, 37, 37 + kept))
    assert spec.num_tokens(1) == plain.num_tokens(1) == 37 + kept
    for t in range(37 + kept, 50):  # then both decode the same tokens alike
        assert torch.equal(_forward(seq, spec, t, t + 1), _forward(seq, plain, t, t + 1))
    for cache in (spec, plain):
        cache.close()


def test_keeping_more_than_the_forward_holds_is_refused(tmp_path):
    cache = TieredKVCache(tiny_config(cold_zone_dir=str(tmp_path)))
    cache.add_sequence(1)
    with pytest.raises(ValueError, match="cannot keep 6 of 5"):
        _forward(SyntheticSequence(1, 10), cache, 0, 5, kept=6)
    cache.close()
