"""The native second pass of a two-pass read scores what the torch path scores, reading the keys
in place in an FP16 pool's records: GQA groups, block sizes, a layer other than the first,
repeated slots."""

from __future__ import annotations

import pytest
import torch

from flashmemory.kvcache import native
from flashmemory.kvcache.config import level_codecs
from flashmemory.kvcache.levels.tensor_pool import TensorPool
from flashmemory.kvcache.manager.blocks import Level
from flashmemory.kvcache.read.selection import rescore_scores

needs_kernel = pytest.mark.skipif(native.library() is None,
                                  reason="no C compiler: the kernel cannot be built here")
LAYERS, SLOTS = 3, 12


def _pool(heads: int, block: int, dim: int, seed: int) -> TensorPool:
    codec = level_codecs("mixed", block, dim)[Level.HOST]  # FP16 keys and values
    pool = TensorPool(Level.HOST, codec, SLOTS, LAYERS, heads, block, dim, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    for slot in range(SLOTS):
        k = torch.randn(LAYERS, heads, block, dim, generator=g)
        pool.put(slot, codec.encode(k, torch.randn(LAYERS, heads, block, dim, generator=g)))
    return pool


@needs_kernel
@pytest.mark.parametrize("heads,group,block,dim",
                         [(1, 1, 16, 8), (2, 6, 16, 128), (3, 3, 8, 64), (2, 4, 32, 32)])
def test_the_kernel_scores_what_the_torch_path_scores(heads, group, block, dim):
    pool = _pool(heads, block, dim, seed=heads * 7 + dim)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(heads * group, dim, generator=g) * 2.0
    slots = torch.randint(0, SLOTS, (heads, 7), generator=g)  # a slot repeated scores twice
    kernel = native.native_rescore(torch.device("cpu"))
    assert kernel is not None
    got = kernel.scores(q, *pool.key_records(2), block, slots)
    records, offset, _ = pool.key_records(2)
    assert kernel.scores(q, records, offset, torch.bfloat16, block, slots) is None  # fp16 keys only
    assert got is not None and got.shape == (heads, 7)
    expected = rescore_scores(q, pool.get_layer_keys_per_head(slots, 2))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.topk(3).indices.sort().values, expected.topk(3).indices.sort().values)


@needs_kernel
def test_shapes_it_does_not_take_fall_back_to_torch():
    pool = _pool(2, 16, 12, seed=0)  # head_dim 12: not a multiple of 8
    kernel = native.native_rescore(torch.device("cpu"))
    assert kernel is not None
    slots = torch.zeros(2, 3, dtype=torch.int64)
    assert kernel.scores(torch.randn(4, 12), *pool.key_records(0), 16, slots) is None
