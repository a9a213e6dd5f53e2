"""ggml's KV row types as numpy arrays, so llama.cpp's KV cache can be written from our FP16 keys and values and
read back (llamacpp_state.py): f16 rows as they are, q8_0 rows as blocks of 32 values (block_q8_0 in
ggml/src/ggml-common.h: an fp16 scale d, then 32 int8 quants q, value = d * q), quantized bit for bit as
quantize_row_q8_0_ref in ggml/src/ggml-quants.c does (llama.cpp as bundled by llama-cpp-python 0.3.36).
numpy only: the llama.cpp bench worker never imports torch."""

from __future__ import annotations

import numpy as np

from flashmemory.errors import KVSnapshotError

GGML_TYPE_F16 = 1
GGML_TYPE_Q8_0 = 8
QK8_0 = 32  # values per q8_0 block
Q8_0_BLOCK = np.dtype([("d", "<f2"), ("qs", "i1", (QK8_0,))])  # 34 bytes, no padding, as ggml's static_assert
# The row element of each type we read and write: one value (f16) or one block of QK8_0 values (q8_0).
ROW_DTYPES: dict[int, np.dtype] = {GGML_TYPE_F16: np.dtype("<f2"), GGML_TYPE_Q8_0: Q8_0_BLOCK}
TYPE_NAMES = {GGML_TYPE_F16: "f16", GGML_TYPE_Q8_0: "q8_0"}


def ggml_type_of(rows: np.ndarray) -> int:
    """The ggml type whose row elements `rows` holds (float16 values or Q8_0 blocks)."""
    for ggml_type, dtype in ROW_DTYPES.items():
        if rows.dtype == dtype:
            return ggml_type
    raise KVSnapshotError(f"KV rows of numpy dtype {rows.dtype} are not one of ggml's f16 or q8_0 rows")


def row_dtype(ggml_type: int, which: str) -> np.dtype:
    """The row element of a ggml type read from a state; KVSnapshotError naming the fix for any other type."""
    dtype = ROW_DTYPES.get(ggml_type)
    if dtype is None:
        raise KVSnapshotError(f"llama.cpp's {which} cache is ggml type {ggml_type}, neither f16 ({GGML_TYPE_F16}) "
                              f"nor q8_0 ({GGML_TYPE_Q8_0}): a snapshot restores into those only (open the model "
                              "with type_k = type_v = f16, or q8_0 with flash attention)")
    return dtype


def quantize_q8_0(values: np.ndarray) -> np.ndarray:
    """[..., n] values (n a multiple of 32) as [..., n // 32] Q8_0 blocks, bit for bit quantize_row_q8_0_ref:
    d = amax / 127 and q = roundf(x * (1 / d)), both in float32, roundf rounding halves away from zero."""
    if values.shape[-1] % QK8_0:
        raise KVSnapshotError(f"a q8_0 row holds whole blocks of {QK8_0} values; this one holds {values.shape[-1]}")
    blocks = values.astype(np.float32).reshape(*values.shape[:-1], -1, QK8_0)  # [..., n // 32, 32]
    d = np.abs(blocks).max(axis=-1) / np.float32(127)
    inverse = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)  # id = d ? 1.0f/d : 0.0f
    scaled = blocks * inverse[..., None]
    quants = np.trunc(scaled)
    quants += np.where(np.abs(scaled - quants) >= 0.5, np.sign(scaled), 0)  # roundf, not numpy's half-to-even
    out = np.empty(blocks.shape[:-1], dtype=Q8_0_BLOCK)
    out["d"] = d.astype(np.float16)
    out["qs"] = quants.astype(np.int8)
    return out


def dequantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    """[..., m] Q8_0 blocks as [..., m * 32] float32 values (d * q, as ggml's dequantize_row_q8_0)."""
    values = blocks["d"].astype(np.float32)[..., None] * blocks["qs"].astype(np.float32)  # [..., m, 32]
    return values.reshape(*blocks.shape[:-1], blocks.shape[-1] * QK8_0)
