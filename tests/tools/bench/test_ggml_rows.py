"""ggml's q8_0 rows in numpy: bit for bit ggml's quantize_row_q8_0_ref, written out one value at a time here."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flashmemory.errors import KVSnapshotError
from flashmemory.tools.bench.ggml_rows import QK8_0, Q8_0_BLOCK, dequantize_q8_0, quantize_q8_0


def _reference_block(x: np.ndarray) -> tuple[np.float16, list[int]]:
    """quantize_row_q8_0_ref for one block, in the C code's float32 steps (roundf: halves away from zero)."""
    amax = np.float32(0)
    for v in x:
        amax = max(amax, np.float32(abs(v)))
    d = np.float32(amax / np.float32(127))
    inverse = np.float32(np.float32(1) / d) if d else np.float32(0)
    quants = []
    for v in x:
        x0 = float(np.float32(np.float32(v) * inverse))
        quants.append(int(math.copysign(math.floor(abs(x0) + 0.5), x0)))
    return np.float16(d), quants


def test_q8_0_blocks_match_ggml_reference_quantization():
    rng = np.random.default_rng(1)
    rows = (rng.standard_normal((3, 4 * QK8_0)) * rng.uniform(0.01, 300, (3, 1))).astype(np.float16)
    rows[1, :QK8_0] = 0  # an all-zero block: d = 0, every quant 0
    rows[2, QK8_0:2 * QK8_0] = np.array([127, 2.5, -3.5, 0.5, -0.5] + [1] * 27, dtype=np.float16)  # ties: d = 1
    blocks = quantize_q8_0(rows)
    assert blocks.dtype == Q8_0_BLOCK and blocks.dtype.itemsize == 34 and blocks.shape == (3, 4)
    for r in range(3):
        for b in range(4):
            d, quants = _reference_block(rows[r, b * QK8_0:(b + 1) * QK8_0].astype(np.float32))
            assert blocks[r, b]["d"] == d and blocks[r, b]["qs"].tolist() == quants
    assert blocks[2, 1]["qs"][:5].tolist() == [127, 3, -4, 1, -1]  # roundf, not numpy's half-to-even


def test_q8_0_dequantizes_within_half_a_step():
    rng = np.random.default_rng(2)
    rows = rng.standard_normal((5, 2 * QK8_0)).astype(np.float32)
    blocks = quantize_q8_0(rows)
    step = np.repeat(blocks["d"].astype(np.float32), QK8_0, axis=-1)
    assert (np.abs(dequantize_q8_0(blocks) - rows) <= step * 0.5 + 1e-3 * step).all()


def test_a_row_that_is_not_whole_blocks_is_refused():
    with pytest.raises(KVSnapshotError, match="whole blocks of 32"):
        quantize_q8_0(np.zeros((2, 48), dtype=np.float16))
