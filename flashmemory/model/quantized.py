"""Weights kept in GGUF block formats (F16 and BF16 too, as blocks of 32 values): the QuantizedTensor
that holds one, its torch reference dequantization,
and the Q8_0 / Q4_0 quantizers used to store a dense checkpoint that way (weights_dtype="q8_0" / "q4_0")."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from flashmemory.model.gguf_dequant import FLOAT16_DTYPES, dequantize_torch

# format -> (weights per block, bytes per block); the formats the native GEMV reads (csrc/quant_gemv.c).
BLOCK_FORMATS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
                 "Q8_0": (32, 34), "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144),
                 "Q5_K": (256, 176), "Q6_K": (256, 210), "IQ4_NL": (32, 18), "IQ4_XS": (256, 136),
                 "F16": (32, 64), "BF16": (32, 64)}
# The unquantized 16-bit formats among them: kept at 2 bytes a weight (half of float32) and always
# multiplied with float x (no 8-bit path: csrc/q8_gemv.c refuses them).
FLOAT16_FORMATS = tuple(FLOAT16_DTYPES)
# The formats with an 8-bit activation GEMV (csrc/q8_gemv.c).
X8_FORMATS = tuple(name for name in BLOCK_FORMATS if name not in FLOAT16_FORMATS)


@dataclass
class QuantizedTensor:
    """A 2-D weight [rows, cols] kept as its GGUF blocks: `blocks` [rows, row_bytes] uint8, one row per output."""

    type_name: str
    blocks: torch.Tensor
    cols: int

    @property
    def rows(self) -> int:
        return self.blocks.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def num_bytes(self) -> int:
        return self.blocks.numel()

    def dequantize(self, first_row: int = 0, num_rows: int | None = None) -> torch.Tensor:
        """float32 [num_rows, cols] of rows first_row.. (the torch reference; the native kernel equals it)."""
        end = self.rows if num_rows is None else first_row + num_rows
        raw = self.blocks[first_row:end].numpy()
        values = dequantize_torch(raw, self.type_name)
        if values is None:  # the K-quants: gguf's numpy kernels are the reference
            import gguf

            qtype = gguf.GGMLQuantizationType[self.type_name]
            values = torch.from_numpy(np.array(gguf.quants.dequantize(raw, qtype), dtype=np.float32))
        return values.reshape(end - first_row, self.cols)


def quantize(weight: torch.Tensor, type_name: str) -> QuantizedTensor:
    """Store a dense [rows, cols] weight (cols a multiple of 32) as Q8_0 or Q4_0 blocks, round to nearest."""
    rows, cols = weight.shape
    x = weight.detach().to("cpu", torch.float32).reshape(rows, cols // 32, 32)  # [rows, blocks, 32]
    if type_name == "Q8_0":
        d = x.abs().amax(-1, keepdim=True) / 127
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        codes = (x * inv).round().clamp(-127, 127).to(torch.int8).view(torch.uint8)
    elif type_name == "Q4_0":
        # The value of largest magnitude maps to code 0 (-8 after the offset), as the format's quantizer does.
        extreme = x.gather(-1, x.abs().argmax(-1, keepdim=True))
        d = extreme / -8
        inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
        q = (x * inv + 8.5).trunc().clamp(0, 15).to(torch.uint8)
        codes = q[..., :16] | (q[..., 16:] << 4)  # byte j: weight j low, weight j + 16 high
    else:
        raise ValueError(f"quantizing to {type_name} is not supported (Q8_0 or Q4_0)")
    scale = d.to(torch.float16).view(torch.uint8)  # [rows, blocks, 2]
    blocks = torch.cat([scale, codes], dim=-1).reshape(rows, -1).contiguous()
    return QuantizedTensor(type_name, blocks, cols)
