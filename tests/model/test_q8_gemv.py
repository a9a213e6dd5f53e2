"""The decode GEMV with 8-bit activations (csrc/q8_gemv.c): for every block format it computes
exactly the float32-dequantized weights times x rounded to 8 bits per 32 values (read in blocks of
32 by the 32-weight formats, in super-blocks of 256 by the K-quants and IQ4_XS), its rows do not
depend on how many rows one call takes (the portable and AVX2 builds: test_kernel_paths.py)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from flashmemory.model.native import quant_kernels
from flashmemory.model.quantized import FLOAT16_FORMATS, X8_FORMATS
from tests.model.test_quantized_weights import _random_blocks, _reference

FORMATS = list(X8_FORMATS)
LIB = quant_kernels.library()
pytestmark = pytest.mark.skipif(LIB is None, reason="no C compiler: the native kernels are absent")


def _rounded(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: per 32 values, d = max|x| / 127 times round(x / d), within +-127."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    codes = torch.round(blocks * inverse).clamp(-127, 127)
    return (codes * (amax / 127.0)).reshape(x.shape)


def _gemv_x8(lib: ctypes.CDLL, type_name: str, blocks: torch.Tensor, cols: int,
             x: torch.Tensor) -> torch.Tensor:
    xq = torch.empty(quant_kernels.x8_bytes(lib, x.shape[0], cols), dtype=torch.uint8)
    quant_kernels.quantize_x8(lib, x, xq)
    out = torch.empty(x.shape[0], blocks.shape[0])
    quant_kernels.qgemv_x8(lib, type_name, blocks, cols, xq, x.shape[0], out)
    return out


@pytest.mark.parametrize("num_x", [1, 5])
@pytest.mark.parametrize("type_name", FORMATS)
def test_the_product_is_the_dequantized_weights_times_the_rounded_x(type_name, num_x):
    rows, cols = 96, 512
    raw = _random_blocks(type_name, rows, cols, seed=num_x + 3)
    blocks = torch.from_numpy(np.ascontiguousarray(raw))
    x = torch.randn(num_x, cols, generator=torch.Generator().manual_seed(num_x))
    w = _reference(raw, type_name, rows, cols)
    out = _gemv_x8(LIB, type_name, blocks, cols, x)
    rounded, exact = _rounded(x) @ w.T, x @ w.T
    kernel_rounded = x.clone()  # the prefill path's rounding is this rule too
    quant_kernels.round_x8(LIB, kernel_rounded)
    torch.testing.assert_close(kernel_rounded, _rounded(x), rtol=0, atol=1e-6)

    def error(y):
        return ((out - y).norm() / y.norm()).item()

    # The rounding of x moves the product by ~0.5 %; the kernel's sums match the rounded x's to
    # ~1e-6 (a rare code that rounds the other way under -ffast-math is one value of 512).
    assert error(rounded) < 1e-4, error(rounded)
    assert 1e-4 < error(exact) < 2e-2, error(exact)


@pytest.mark.parametrize("type_name", FORMATS)
def test_each_row_is_the_one_row_product_bit_for_bit(type_name):
    """A speculative verification's rows must be what each decode step computes alone."""
    rows, cols = 64, 512
    blocks = torch.from_numpy(np.ascontiguousarray(_random_blocks(type_name, rows, cols, seed=11)))
    x = torch.randn(quant_kernels.MAX_X_ROWS, cols, generator=torch.Generator().manual_seed(1))
    together = _gemv_x8(LIB, type_name, blocks, cols, x)
    for r in range(x.shape[0]):
        alone = _gemv_x8(LIB, type_name, blocks, cols, x[r : r + 1])
        assert torch.equal(together[r], alone[0]), f"row {r}"


def test_a_shape_the_kernel_does_not_take_is_refused():
    blocks = torch.from_numpy(np.ascontiguousarray(_random_blocks("Q4_K", 8, 256)))
    xq = torch.empty(quant_kernels.x8_bytes(LIB, 1, 512), dtype=torch.uint8)
    with pytest.raises(ValueError, match="refused a Q4_K weight of 8 x 512"):
        quant_kernels.qgemv_x8(LIB, "Q4_K", blocks, 512, xq, 1, torch.empty(1, 8))


def test_the_setting_resolves_by_what_the_cpu_runs_and_auto_by_format():
    assert quant_kernels.resolve_decode_activations("float32", LIB) == "float32"
    assert quant_kernels.resolve_decode_activations("int8", LIB) == "int8"
    assert quant_kernels.resolve_decode_activations("auto", None) == "float32"
    expected = "auto" if LIB.fm_x8_vectorized() else "float32"
    assert quant_kernels.resolve_decode_activations("auto", LIB) == expected
    # auto: int8 x where the float path dequantizes each block first, float x where it has a
    # one-row vector dot
    assert [f for f in FORMATS if quant_kernels.int8_for("auto", f)] == [
        f for f in FORMATS if f not in ("Q4_0", "Q4_1", "Q5_0", "Q8_0")]
    assert all(quant_kernels.int8_for("int8", f) for f in FORMATS)
    assert not any(quant_kernels.int8_for("float32", f) for f in FORMATS)
    with pytest.raises(ValueError, match="decode_activations='int4'"):
        quant_kernels.resolve_decode_activations("int4", LIB)


def test_the_head_keeps_float_x_only_where_its_format_has_a_one_row_float_dot():
    one_row = ("Q4_0", "Q4_1", "Q5_0", "Q8_0")
    for mode in ("auto", "int8"):
        assert [f for f in FORMATS if quant_kernels.int8_for_head(mode, f)] == [
            f for f in FORMATS if f not in one_row]  # a Q6_K head (Qwen2.5-1.5B) rounds x
    assert not any(quant_kernels.int8_for_head("float32", f) for f in FORMATS)


def test_the_16_bit_formats_keep_float_x_and_have_no_8_bit_path():
    """F16 / BF16 weights are multiplied with x as it is whatever decode_activations says: the
    8-bit kernel refuses them rather than reading 2-byte values as blocks."""
    for type_name in FLOAT16_FORMATS:
        assert not any(quant_kernels.int8_for(mode, type_name) or
                       quant_kernels.int8_for_head(mode, type_name)
                       for mode in ("auto", "int8", "float32"))
        blocks = torch.from_numpy(np.ascontiguousarray(_random_blocks(type_name, 8, 256)))
        with pytest.raises(ValueError, match=f"refused a {type_name}"):
            _gemv_x8(LIB, type_name, blocks, 256, torch.randn(1, 256))
