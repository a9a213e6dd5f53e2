"""Projections and the embedding whose weights are dense or kept in GGUF block formats (QuantizedTensor).

Decode (a few rows of x) runs the native GEMV over the blocks, for the formats decode_activations
picks with x rounded to 8 bits once per projection and integer dots; prefill dequantizes tiles of rows
into one float32 buffer per model (DequantWorkspace) and hands each tile to torch's GEMM, so no
full float32 copy of a weight ever exists. Without the native library the tiles come from the
torch reference dequantization.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashmemory.model.native import quant_kernels
from flashmemory.model.native.projection import NativeProjection
from flashmemory.model.quantized import QuantizedTensor

# float32 weights per prefill tile (16 MiB): a layer's matrices fit whole (one GEMM each, as dense weights get:
# smaller tiles measured 20 % slower), the LM head and large models' matrices go in row tiles.
TILE_ELEMENTS = 1 << 22

Part = torch.Tensor | QuantizedTensor


class DequantWorkspace:
    """Owns the float32 buffer prefill tiles are dequantized into and the buffer decode rows of x
    are quantized into, shared by every projection of one model; `activations` is the decode
    GEMV's ("int8", "float32", or "auto": int8 by format, quant_kernels.int8_for)."""

    def __init__(self, decode_activations: str = "auto") -> None:
        self._buffer = torch.empty(0)
        self._x8 = torch.empty(0, dtype=torch.uint8)
        self.native = quant_kernels.library()
        self.activations = quant_kernels.resolve_decode_activations(decode_activations, self.native)

    def x8_room(self, rows: int, cols: int) -> torch.Tensor:
        """The buffer 8-bit x is written into, with room for `rows` rows of `cols` values."""
        size = quant_kernels.x8_bytes(self.native, rows, cols)
        if self._x8.numel() < size:
            self._x8 = torch.empty(size, dtype=torch.uint8)
        return self._x8

    def quantized_x(self, x: torch.Tensor, layouts: int) -> torch.Tensor:
        """x [n, cols] float32 rounded to 8 bits in the layouts `layouts` names
        (quant_kernels.x8_layouts; valid until the next call)."""
        room = self.x8_room(x.shape[0], x.shape[1])
        quant_kernels.quantize_x8(self.native, x, room, layouts)
        return room

    def tile(self, num_rows: int, cols: int) -> torch.Tensor:
        if self._buffer.numel() < num_rows * cols:
            self._buffer = torch.empty(num_rows * cols)
        return self._buffer[: num_rows * cols].view(num_rows, cols)

    def dequantize(self, part: QuantizedTensor, first_row: int, num_rows: int) -> torch.Tensor:
        """Rows first_row.. of `part` as float32 [num_rows, cols], in the shared buffer (valid until the next call)."""
        out = self.tile(num_rows, part.cols)
        if self.native is not None:
            quant_kernels.dequant_rows(self.native, part.type_name, part.blocks, part.cols, out, first_row=first_row)
        else:
            out.copy_(part.dequantize(first_row, num_rows))
        return out


def _register(module: nn.Module, parts: list[Part]) -> None:
    # Buffers so that .to() and state inspection see the blocks; names are positional.
    for i, part in enumerate(parts):
        module.register_buffer(f"part{i}", part.blocks if isinstance(part, QuantizedTensor) else part, persistent=False)


class DenseLinear(nn.Linear):
    """nn.Linear whose weight may be stored in another dtype than the activations (weights_dtype="bfloat16")."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        return F.linear(x.to(w.dtype), w, None if self.bias is None else self.bias.to(w.dtype)).to(x.dtype)


class QuantizedLinear(nn.Module):
    """y = x W^T (+ b) with W stored as row parts ([q; k; v] or [gate; up]), each quantized or
    dense. `float_activations` (the LM head): decode keeps x in float32 for the parts whose format
    has a one-row float dot, whatever the workspace's activations (the head's logits are what a
    user sees, and rounding its x was the largest share of int8's KL on SmolLM2); a head in another
    format (Qwen2.5-1.5B's Q6_K) follows the workspace (quant_kernels.int8_for_head)."""

    def __init__(self, parts: list[Part], bias: torch.Tensor | None, workspace: DequantWorkspace,
                 float_activations: bool = False) -> None:
        super().__init__()
        self.parts = _merge_same_format(parts)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.workspace = workspace
        # Per part: whether its GEMV rounds x to 8 bits (by its format; never for the LM head).
        rule = quant_kernels.int8_for_head if float_activations else quant_kernels.int8_for
        self.int8_parts = [isinstance(p, QuantizedTensor) and rule(workspace.activations, p.type_name)
                           for p in self.parts]
        self.int8_activations = any(self.int8_parts)
        self.out_features = sum(p.shape[0] for p in self.parts)
        _register(self, self.parts)
        # The decode path's one native call over every part, prepared once; None when a part is
        # dense or the kernels are absent.
        self.native_projection: NativeProjection | None = None
        if workspace.native is not None and all(isinstance(p, QuantizedTensor) for p in self.parts):
            calls, start = [], 0
            for p, int8 in zip(self.parts, self.int8_parts):
                calls.append((int8, quant_kernels.TYPE_IDS[p.type_name], p.blocks, p.cols, start))
                start += p.rows
            self.native_projection = NativeProjection(workspace.native, calls, self.out_features,
                                                      self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] -> [T, out]
        if self.native_projection is not None and x.dim() == 2 \
                and 0 < x.shape[0] <= quant_kernels.MAX_X_ROWS \
                and x.dtype == torch.float32:
            return self._decode(x.contiguous())
        lead = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])
        x32 = x.float().contiguous()
        rounded = x32
        if self.int8_activations and x32.shape[0] > 0:
            # The rows as the 8-bit GEMV sees them, for the parts that round x, whatever the path
            # below (GEMM for many rows, the GEMV for a few): a token's numbers do not depend on
            # whether it came in a chunk of a few rows or of many.
            rounded = x32.clone()
            quant_kernels.round_x8(self.workspace.native, rounded)
        out = torch.empty(x.shape[0], self.out_features)
        start = 0
        for part, int8 in zip(self.parts, self.int8_parts):
            rows = part.shape[0]
            self._project(part, rounded if int8 else x32, out[:, start : start + rows], int8)
            start += rows
        if self.bias is not None:
            out += self.bias
        return out.to(x.dtype).reshape(*lead, self.out_features)

    def _decode(self, x: torch.Tensor) -> torch.Tensor:
        """The few-rows path with nothing between the caller and the kernels but one native call
        (x rounded to 8 bits once, for the parts that take it; each part's GEMV; the bias)."""
        out = torch.empty(x.shape[0], self.out_features)
        self.native_projection.project(x, self.workspace.x8_room(x.shape[0], x.shape[1]), out)
        return out

    def _project(self, part: Part, x: torch.Tensor, out: torch.Tensor, int8: bool) -> None:
        if not isinstance(part, QuantizedTensor):
            out.copy_(F.linear(x, part.float()))
            return
        native = self.workspace.native
        if x.shape[0] == 0:  # a prefill chunk whose logits are not wanted
            return
        if native is not None and x.shape[0] <= quant_kernels.MAX_X_ROWS:
            if int8:
                layouts = quant_kernels.x8_layouts(native, [quant_kernels.TYPE_IDS[part.type_name]])
                quant_kernels.qgemv_x8(native, part.type_name, part.blocks, part.cols,
                                       self.workspace.quantized_x(x, layouts), x.shape[0], out)
            else:
                quant_kernels.qgemv(native, part.type_name, part.blocks, part.cols, x, out)
            return
        tile_rows = max(1, TILE_ELEMENTS // part.cols)
        for first in range(0, part.rows, tile_rows):
            n = min(tile_rows, part.rows - first)
            tile = self.workspace.dequantize(part, first, n)
            if n == out.shape[1] and out.is_contiguous():  # the whole output in one GEMM, written in place
                torch.mm(x, tile.t(), out=out)
            else:
                out[:, first : first + n] = x @ tile.t()

    def weight_bytes(self) -> int:
        return sum(p.num_bytes if isinstance(p, QuantizedTensor) else p.numel() * p.element_size() for p in self.parts)


class QuantizedEmbedding(nn.Module):
    """Token embeddings kept as blocks; a lookup dequantizes just the rows asked for."""

    def __init__(self, table: QuantizedTensor, workspace: DequantWorkspace, dtype: torch.dtype) -> None:
        super().__init__()
        self.table = table
        self.workspace = workspace
        self.dtype = dtype
        _register(self, [table])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [T] -> [T, hidden]
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        native = self.workspace.native
        if native is not None:
            out = torch.empty(flat.shape[0], self.table.cols)
            quant_kernels.dequant_rows(native, self.table.type_name, self.table.blocks, self.table.cols, out,
                                       row_ids=flat)
        else:
            out = torch.stack([self.table.dequantize(int(i), 1)[0] for i in flat]) if flat.numel() else \
                torch.empty(0, self.table.cols)
        return out.to(self.dtype).reshape(*ids.shape, self.table.cols)


def _merge_same_format(parts: list[Part]) -> list[Part]:
    """Adjacent parts of one block format become one (a single GEMV call); a dense run stays dense."""
    merged: list[Part] = []
    for part in parts:
        last = merged[-1] if merged else None
        if isinstance(part, QuantizedTensor) and isinstance(last, QuantizedTensor) \
                and last.type_name == part.type_name and last.cols == part.cols:
            merged[-1] = QuantizedTensor(part.type_name, torch.cat([last.blocks, part.blocks]), part.cols)
        elif isinstance(part, torch.Tensor) and isinstance(last, torch.Tensor):
            merged[-1] = torch.cat([last, part])
        else:
            merged.append(part)
    return merged
