"""Torch dequantization of the common GGUF block types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1; F16 / BF16);
others go through `gguf.quants`, whose numpy kernels are the reference (tests check ours equal them
bit for bit).

Block layouts (llama.cpp's ggml-common.h), 32 weights per block:
    Q8_0: fp16 d, 32 x int8 q                            -> d * q
    Q4_0: fp16 d, 16 bytes of nibbles                    -> d * (q - 8)
    Q4_1: fp16 d, fp16 m, 16 bytes nibbles               -> d * q + m
    Q5_0: fp16 d, 4 bytes high bits, 16 bytes nibbles    -> d * (q - 16)
    Q5_1: fp16 d, fp16 m, 4 bytes high bits, 16 nibbles  -> d * q + m
Nibbles: byte j holds weight j in its low half and weight j + 16 in its high half. High bits: bit j of the
little-endian 32-bit word is the fifth bit of weight j.
"""

from __future__ import annotations

import numpy as np
import torch

BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24}
FLOAT16_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16}  # unquantized, 2 bytes a value


def _fp16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    # blocks: [..., n, block_bytes] uint8 -> [..., n, 1] float32 from the 2 bytes at `start`
    return blocks[..., start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    # q: [..., n, 16] uint8 -> [..., n, 32] uint8 in weight order
    return torch.cat((q & 0x0F, q >> 4), dim=-1)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    # qh: [..., n, 4] uint8 -> [..., n, 32] uint8 holding 0 or 16; byte b bit i is weight 8 * b + i
    shifts = torch.arange(8, dtype=torch.uint8)
    bits = (qh[..., :, None] >> shifts) & 1  # [..., n, 4, 8]
    return bits.flatten(-2) << 4


def dequantize_torch(raw: np.ndarray, type_name: str) -> torch.Tensor | None:
    """float32 [rows, cols] from raw [rows, bytes per row] uint8, or None when the type is not handled here."""
    if type_name not in BLOCK_BYTES and type_name not in FLOAT16_DTYPES:
        return None
    data = torch.from_numpy(np.array(raw, copy=True))  # the file map is read-only; torch wants writable memory
    if type_name in FLOAT16_DTYPES:  # [rows, 2 * cols] bytes of 16-bit values
        return data.view(FLOAT16_DTYPES[type_name]).float()
    rows = data.shape[0]
    blocks = data.view(rows, -1, BLOCK_BYTES[type_name])  # [rows, blocks, block_bytes]
    if type_name == "Q8_0":
        values = _fp16(blocks, 0) * blocks[..., 2:].contiguous().view(torch.int8).float()
    elif type_name == "Q4_0":
        values = _fp16(blocks, 0) * (_nibbles(blocks[..., 2:]).float() - 8)
    elif type_name == "Q4_1":
        values = _fp16(blocks, 0) * _nibbles(blocks[..., 4:]).float() + _fp16(blocks, 2)
    elif type_name == "Q5_0":
        q = _nibbles(blocks[..., 6:]) | _fifth_bits(blocks[..., 2:6])
        values = _fp16(blocks, 0) * (q.float() - 16)
    else:
        q = _nibbles(blocks[..., 8:]) | _fifth_bits(blocks[..., 4:8])
        values = _fp16(blocks, 0) * q.float() + _fp16(blocks, 2)
    return values.reshape(rows, -1)
