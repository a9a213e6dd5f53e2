"""The codec error bound MATS judges quantized reads by: it holds, and it is tight (not a loose tolerance)."""

from __future__ import annotations

import pytest
import torch

from flashmemory.kvcache.quant import Codec
from flashmemory.tools.mats.bounds import kv_error_bound
from flashmemory.tools.mats.checker import compare


@pytest.mark.parametrize("bits", [4, 2])
def test_the_bound_holds_for_every_element_and_is_reached(bits):
    codec = Codec(bits, 8, 32, quant_range="minmax")
    g = torch.Generator().manual_seed(bits)
    worst = 0.0
    for scale in (1e-3, 1.0, 30.0):
        k = (torch.randn(2, 8, 32, generator=g) * scale + scale).half()  # [kv_heads, tokens, D], fp16 as stored
        v = (torch.randn(2, 8, 32, generator=g) * scale).half()
        decoded = codec.decode(codec.encode(k, v), torch.float32).double()
        error = (decoded - torch.stack((k, v)).double()).abs()
        bound = kv_error_bound(k, v, bits, 8, 32)
        assert bool((error <= bound).all())
        worst = max(worst, float((error / bound).max()))
    assert worst > 0.9  # half a step is really reached: the bound is not padded


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("quant_range", ["mse", "mse-values"])
def test_the_bound_holds_with_the_mse_range(bits, quant_range):
    codec = Codec(bits, 8, 32, quant_range=quant_range)
    g = torch.Generator().manual_seed(10 + bits)
    for scale in (1e-3, 1.0, 30.0):
        k = (torch.randn(2, 8, 32, generator=g) * scale + scale).half()
        v = (torch.randn(2, 8, 32, generator=g) * scale).half()
        v[..., 5] *= 6  # an outlier the shrunk range clamps
        decoded = codec.decode(codec.encode(k, v), torch.float32).double()
        error = (decoded - torch.stack((k, v)).double()).abs()
        assert bool((error <= kv_error_bound(k, v, bits, 8, 32, codec.key_shrink, codec.value_shrink)).all())


@pytest.mark.parametrize("quant_range", ["minmax", "mse"])
def test_a_one_step_error_in_a_quantized_read_is_caught(quant_range):
    codec = Codec(4, 8, 32, quant_range=quant_range)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 8, 32, generator=g).half(), torch.randn(2, 8, 32, generator=g).half()
    parts = codec.encode(k, v)
    assert compare(codec, parts, k, v)[0] is None
    parts["codes"][0, 0, 3, 0] ^= 1 << 4  # the second code of the byte moves by one step
    problem, ratio = compare(codec, parts, k, v)
    assert problem is not None
    if quant_range == "minmax":  # beyond the bound itself; the mse bound allows for clamping, the parts check catches it
        assert ratio > 1


def test_a_flipped_scale_bit_is_caught_by_the_encoding_check_even_within_the_bound():
    codec = Codec(2, 8, 32)
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 8, 32, generator=g).half(), torch.randn(2, 8, 32, generator=g).half()
    parts = codec.encode(k, v)
    parts["k_scale"].view(torch.int16)[0, 0, 0] ^= 1  # the last mantissa bit: a tiny change
    problem, _ = compare(codec, parts, k, v)
    assert problem is not None and "differs" in problem
