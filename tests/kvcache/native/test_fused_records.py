"""The decode kernel's fused INT4 / INT2 path (query scaled per key group and dotted with the codes, value scales
folded into the softmax weights, exp by polynomial) against a float64 reference: Codec.decode, then a plain softmax
attention. Formats the fused path does not take (value groups or packed rows not a multiple of 8 channels / bytes)
go through the kernel's dequantizing path and are checked the same way."""

from __future__ import annotations

import pytest
import torch

from flashmemory.kvcache import native
from flashmemory.kvcache.levels.tensor_pool import TensorPool
from flashmemory.kvcache.manager.blocks import Level
from flashmemory.kvcache.native import DecodeState
from flashmemory.kvcache.quant import Codec

needs_kernel = pytest.mark.skipif(native.library() is None, reason="no C compiler: the kernel cannot be built here")
HEADS, SLOTS, READ = 2, 24, 11


def _reference(q: torch.Tensor, kv: torch.Tensor, group: int) -> torch.Tensor:
    """q [heads * group, D], kv [2, heads, n, block, D] -> softmax(q k / sqrt(D)) v in float64."""
    keys, values = kv[0].flatten(1, 2).double(), kv[1].flatten(1, 2).double()  # [heads, n * block, D]
    qh = q.double().view(HEADS, group, -1)  # [heads, group, D]
    scores = qh @ keys.transpose(1, 2) / q.shape[1] ** 0.5
    return (scores.softmax(-1) @ values).reshape(q.shape)


def _check(bits: int, group: int, block: int, dim: int, key_group: int, value_group: int, threads: int) -> None:
    torch.manual_seed(bits * 1000 + group * 100 + key_group * 10 + value_group)
    codec = Codec(bits, key_group, value_group)
    pool = TensorPool(Level.DEVICE, codec, SLOTS, 1, HEADS, block, dim, torch.device("cpu"))
    for slot in range(SLOTS):
        k = torch.randn(1, HEADS, block, dim) * 2 + torch.randn(1, HEADS, 1, dim)  # channel offsets, as real keys
        pool.put(slot, codec.encode(k, torch.randn(1, HEADS, block, dim) + 0.5))
    slots = torch.stack([torch.randperm(SLOTS)[:READ] for _ in range(HEADS)])
    q = torch.randn(HEADS * group, dim) * 2  # peaked enough that the running max and rescaling matter

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        state = DecodeState(native.library(), q, HEADS)
        state.add_records(pool.storage[0], slots, native.RecordFormat.for_pool(pool))
        ours = state.output()
    finally:
        torch.set_num_threads(before)

    kv = codec.decode(pool.get_layer_per_head(slots, 0), torch.float64)  # [2, heads, n, block, D]
    torch.testing.assert_close(ours.double(), _reference(q, kv, group), rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("key_group, value_group", [(16, 32), (16, 8), (8, 16), (4, 64), (1, 32)])
@pytest.mark.parametrize("group", [1, 3, 7])
@pytest.mark.parametrize("bits", [4, 2])
def test_fused_records_equal_decode_then_attention(bits, group, key_group, value_group, threads):
    _check(bits, group, 16, 64, key_group, value_group, threads)


@needs_kernel
@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("block, dim, key_group, value_group", [
    (12, 64, 3, 32),  # a block of 12: the softmax's 8-wide exp runs past the last token; odd key groups
    (16, 32, 16, 32),  # INT2 rows of 8 bytes: the narrowest the fused path takes
    (16, 64, 16, 4),  # value groups of 4 channels: the dequantizing path
    (16, 40, 8, 8),  # INT4 rows of 20 bytes: the dequantizing path
])
def test_block_shapes_at_the_edges_of_the_fused_path(bits, block, dim, key_group, value_group):
    _check(bits, 3, block, dim, key_group, value_group, 1)
