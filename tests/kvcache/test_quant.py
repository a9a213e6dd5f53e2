"""Codec round trips: INT4/INT2 errors stay within half a quantization step of a float reference."""

from __future__ import annotations

import pytest
import torch

from flashmemory.kvcache.quant import Codec, pack, unpack


@pytest.mark.parametrize("bits", [2, 4])
def test_pack_unpack_is_lossless(bits):
    codes = torch.randint(0, 1 << bits, (3, 5, 64), dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.shape == (3, 5, 64 * bits // 8)
    assert torch.equal(unpack(packed, bits), codes)


@pytest.mark.parametrize("bits", [2, 4])
def test_round_trip_error_is_bounded_by_half_a_step(bits):
    torch.manual_seed(0)
    k = torch.randn(30, 3, 16, 64) * 2 + torch.randn(1, 1, 1, 64) * 5  # per-channel offsets, like real keys
    v = torch.randn(30, 3, 16, 64)
    codec = Codec(bits=bits, key_group_tokens=16, value_group_channels=32, quant_range="minmax")
    parts = codec.encode(k, v)
    k2, v2 = codec.decode(parts, torch.float32)
    levels = (1 << bits) - 1
    # Keys: per channel over the 16 tokens; values: per token over 32-channel groups.
    k_step = (k.amax(-2, keepdim=True) - k.amin(-2, keepdim=True)) / levels
    vg = v.reshape(30, 3, 16, 2, 32)
    v_step = ((vg.amax(-1, keepdim=True) - vg.amin(-1, keepdim=True)) / levels).expand_as(vg).reshape(v.shape)
    # Half a step plus fp16 rounding of scale and zero point.
    assert ((k2 - k).abs() <= k_step / 2 + 1e-2 * k.abs().amax()).all()
    assert ((v2 - v).abs() <= v_step / 2 + 1e-2 * v.abs().amax()).all()


@pytest.mark.parametrize("bits", [2, 4])
def test_the_mse_range_never_loses_to_min_max_in_any_group(bits):
    torch.manual_seed(2)
    k = torch.randn(6, 2, 16, 64) * 2 + torch.randn(1, 1, 1, 64) * 5
    v = torch.randn(6, 2, 16, 64)
    v[..., 3] *= 8  # an outlier channel, which min/max spends its range on
    errors = {}
    for quant_range in ("minmax", "mse"):
        codec = Codec(bits=bits, quant_range=quant_range)
        k2, v2 = codec.decode(codec.encode(k, v), torch.float32)
        # Squared error per group: keys per (channel, 16 tokens), values per (token, 32 channels).
        errors[quant_range] = ((k2 - k).square().sum(-2), (v2 - v).square().reshape(6, 2, 16, 2, 32).sum(-1))
    for mse_err, minmax_err in zip(errors["mse"], errors["minmax"]):
        assert (mse_err <= minmax_err * (1 + 1e-5) + 1e-6).all()
    if bits == 2:  # four levels: shrinking pays on Gaussian groups
        assert errors["mse"][1].sum() < 0.8 * errors["minmax"][1].sum()


def test_an_unknown_quant_range_is_refused():
    with pytest.raises(ValueError, match="quant_range"):
        Codec(4, quant_range="max")


def test_int4_keeps_relative_error_small_and_int2_larger():
    torch.manual_seed(1)
    k, v = torch.randn(4, 2, 16, 64), torch.randn(4, 2, 16, 64)
    err = {}
    for bits in (2, 4):
        k2, v2 = Codec(bits).decode(Codec(bits).encode(k, v), torch.float32)
        err[bits] = ((k2 - k).norm() / k.norm()).item()
    assert err[4] < 0.1 < err[2] < 0.5


def test_fp16_codec_is_a_cast():
    k, v = torch.randn(2, 16, 8), torch.randn(2, 16, 8)
    k2, v2 = Codec(16).decode(Codec(16).encode(k, v), torch.float32)
    assert torch.equal(k2, k.half().float()) and torch.equal(v2, v.half().float())


@pytest.mark.parametrize("bits", [2, 4, 16])
def test_nbytes_matches_the_encoded_parts(bits):
    codec = Codec(bits)
    parts = codec.encode(torch.randn(30, 3, 16, 64), torch.randn(30, 3, 16, 64))
    assert codec.nbytes((30, 3), 16, 64) == sum(p.numel() * p.element_size() for p in parts.values())
    shapes = codec.part_shapes((30, 3), 16, 64)
    assert {name: (tuple(p.shape), p.dtype) for name, p in parts.items()} == shapes


@pytest.mark.parametrize("bits", [2, 4, 16])
def test_decode_into_a_slice_of_a_larger_buffer_writes_exactly_there(bits):
    # Decode steps decode a level's blocks straight into their span of the attention buffer.
    codec = Codec(bits)
    parts = codec.encode(torch.randn(3, 5, 16, 64), torch.randn(3, 5, 16, 64))
    buffer = torch.zeros(2, 3, 200, 64)
    span = buffer[:, :, 10:90].view(2, 3, 5, 16, 64)
    codec.decode(parts, torch.float32, out=span)
    assert torch.equal(span, codec.decode(parts, torch.float32))
    assert buffer[:, :, :10].abs().sum() == 0 and buffer[:, :, 90:].abs().sum() == 0  # nothing outside the span


@pytest.mark.parametrize("bits", [2, 4])
def test_the_native_range_choice_matches_the_torch_loop(bits, monkeypatch):
    from flashmemory.kvcache.native import library

    if library() is None:
        pytest.skip("the native kernels cannot be built here (no C compiler, or FLASHMEMORY_NATIVE=0)")
    torch.manual_seed(3)
    k = torch.randn(5, 2, 32, 64) * 2 + torch.randn(1, 1, 1, 64) * 5
    v = torch.randn(5, 2, 32, 64)
    codec = Codec(bits=bits, key_group_tokens=16, value_group_channels=32, quant_range="mse")
    native = codec.encode(k, v)
    monkeypatch.setattr("flashmemory.kvcache.quant._native_range", lambda *args: None)
    reference = codec.encode(k, v)
    for name in ("k_scale", "k_zero", "v_scale", "v_zero"):
        # Float error sums in another order can break a near-tie between two factors the other way: rare.
        agree = (native[name] == reference[name]).float().mean().item()
        assert agree > 0.99, (name, agree)
    k_n, v_n = codec.decode(native, torch.float32)
    k_r, v_r = codec.decode(reference, torch.float32)
    assert abs((k_n - k).square().sum() / (k_r - k).square().sum() - 1) < 1e-3
    assert abs((v_n - v).square().sum() / (v_r - v).square().sum() - 1) < 1e-3


def test_mse_values_keeps_the_keys_min_max_and_shrinks_only_the_values():
    torch.manual_seed(4)
    k, v = torch.randn(3, 2, 16, 64), torch.randn(3, 2, 16, 64)
    parts = {r: Codec(2, quant_range=r).encode(k, v) for r in ("minmax", "mse", "mse-values")}
    for name in ("k_scale", "k_zero"):
        assert torch.equal(parts["mse-values"][name], parts["minmax"][name])
    for name in ("v_scale", "v_zero"):
        assert torch.equal(parts["mse-values"][name], parts["mse"][name])
