"""Torch dequantization of the common GGUF block types (Q8_0, Q4_0, Q4_1); others go through `gguf.quants`.

Block layouts (llama.cpp's ggml-common.h), 32 weights per block:
    Q8_0: fp16 d, 32 x int8 q              -> d * q
    Q4_0: fp16 d, 16 bytes of nibbles      -> d * (q - 8)
    Q4_1: fp16 d, fp16 m, 16 bytes nibbles -> d * q + m
Nibbles: byte j holds weight j in its low half and weight j + 16 in its high half.
"""

from __future__ import annotations

import numpy as np
import torch


def _fp16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    # blocks: [..., n, block_bytes] uint8 -> [..., n, 1] float32 from the 2 bytes at `start`
    return blocks[..., start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    # q: [..., n, 16] uint8 -> [..., n, 32] float32 in weight order
    return torch.cat((q & 0x0F, q >> 4), dim=-1).float()


def dequantize_torch(raw: np.ndarray, type_name: str) -> torch.Tensor | None:
    """float32 [rows, cols] from raw [rows, bytes per row] uint8, or None when the type is not handled here."""
    sizes = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
    if type_name not in sizes:
        return None
    data = torch.from_numpy(np.array(raw, copy=True))  # the file map is read-only; torch wants writable memory
    rows = data.shape[0]
    blocks = data.view(rows, -1, sizes[type_name])  # [rows, blocks, block_bytes]
    if type_name == "Q8_0":
        values = _fp16(blocks, 0) * blocks[..., 2:].contiguous().view(torch.int8).float()
    elif type_name == "Q4_0":
        values = _fp16(blocks, 0) * (_nibbles(blocks[..., 2:]) - 8)
    else:
        values = _fp16(blocks, 0) * _nibbles(blocks[..., 4:]) + _fp16(blocks, 2)
    return values.reshape(rows, -1)
