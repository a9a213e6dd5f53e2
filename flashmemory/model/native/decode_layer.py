"""A decoder layer's decode step as two native calls (csrc/decode_layer.c): everything before the KV
cache (RMSNorm, the q/k/v projection, RoPE) and everything after it (the output projection, the
residuals, RMSNorm, the SwiGLU MLP). Both compute the per-op path's bits (the same kernels in the
same order); they replace ~20 torch dispatches and Python calls per layer, which at a short context
cost as much as a third of SmolLM2's step. Only where every projection keeps its blocks and runs
the native GEMV, activations are float32 on the CPU and the layer has no per-head q/k norm (Qwen3,
whose norm runs in torch); otherwise `FusedDecodeLayer.build` gives None: llama.py runs per op."""

from __future__ import annotations

import ctypes

import torch

from flashmemory.model.linear import QuantizedLinear
from flashmemory.model.native import quant_kernels
from flashmemory.model.native.projection import NativeProjection

_I64, _PTR, _INT, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float


def _declare(lib: ctypes.CDLL) -> None:
    if getattr(lib, "_fm_layer_declared", False):
        return
    lib.fm_layer_pre.restype = _INT
    lib.fm_layer_pre.argtypes = [_PTR, _I64, _I64, _PTR, _F32, _PTR, _I64, _I64, _I64, _PTR, _PTR,
                                 _PTR, _PTR, _PTR, _INT]
    lib.fm_layer_post.restype = _INT
    lib.fm_layer_post.argtypes = [_PTR, _PTR, _I64, _I64, _I64, _PTR, _PTR, _F32, _PTR, _PTR, _I64,
                                  _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _INT]
    lib._fm_layer_declared = True


def _native_projection(linear: object) -> NativeProjection | None:
    return linear.native_projection if isinstance(linear, QuantizedLinear) else None


def _float_cpu(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()


class FusedDecodeLayer:
    """The two calls for one layer; `takes(x, cos, sin)` says whether a forward's rows can use
    them."""

    def __init__(self, lib: ctypes.CDLL, layer: torch.nn.Module, qkv: NativeProjection,
                 o: NativeProjection, gate_up: NativeProjection, down: NativeProjection) -> None:
        _declare(lib)
        self.lib = lib
        attn, mlp = layer.self_attn, layer.mlp
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.q_size, self.kv_size = attn.q_size, attn.kv_size
        self.dim = layer.input_layernorm.weight.shape[0]
        self.inter = mlp.intermediate_size
        self.norm1, self.norm2 = layer.input_layernorm, layer.post_attention_layernorm
        self.qkv, self.o, self.gate_up, self.down = qkv, o, gate_up, down
        # the input widths: 8-bit x's buffer must hold the largest (by fm_x8_bytes, whose
        # super-block layout exists only for widths a multiple of 256: not always the widest)
        self._cols = (qkv.cols, o.cols, gate_up.cols, down.cols)
        self._x8 = torch.empty(0, dtype=torch.uint8)
        self._x8_bytes: dict[int, int] = {}  # rows of x -> bytes its 8-bit copy needs (made once)

    @staticmethod
    def build(layer: torch.nn.Module) -> FusedDecodeLayer | None:
        lib = quant_kernels.library()
        if lib is None or getattr(layer.self_attn, "q_norm", None) is not None:
            return None
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        if not all(_float_cpu(w) for w in norms):
            return None
        linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                   layer.mlp.down_proj)
        projections = [_native_projection(p) for p in linears]
        if any(p is None for p in projections):
            return None
        qkv, o, gate_up, down = projections
        return FusedDecodeLayer(lib, layer, qkv, o, gate_up, down)

    def takes(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        return (x.dim() == 2 and 0 < x.shape[0] <= quant_kernels.MAX_X_ROWS and _float_cpu(x)
                and _float_cpu(cos) and _float_cpu(sin))

    def _xq(self, rows: int) -> torch.Tensor:
        size = self._x8_bytes.get(rows)
        if size is None:
            size = max(quant_kernels.x8_bytes(self.lib, rows, cols) for cols in self._cols)
            self._x8_bytes[rows] = size
        if self._x8.numel() < size:
            self._x8 = torch.empty(size, dtype=torch.uint8)
        return self._x8

    def pre(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, dim] -> q [T, H, D], k and v [T, Hk, D] (views of one new [T, q + 2 kv] tensor)."""
        rows = x.shape[0]
        out = torch.empty(rows, self.qkv.out_features)
        normed = torch.empty(rows, self.dim)
        rc = self.lib.fm_layer_pre(x.data_ptr(), rows, self.dim, self.norm1.weight.data_ptr(),
                                   self.norm1.eps, self.qkv.ref, self.heads, self.kv_heads,
                                   self.head_dim, cos.data_ptr(), sin.data_ptr(),
                                   normed.data_ptr(), self._xq(rows).data_ptr(), out.data_ptr(),
                                   torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"the fused decode layer's q/k/v GEMV refused its weights (code {rc})")
        q, k, v = out.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (q.view(rows, self.heads, self.head_dim), k.view(rows, self.kv_heads, self.head_dim),
                v.view(rows, self.kv_heads, self.head_dim))

    def post(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """x [T, dim] (the layer's input) and attention's output [T, H, D] -> the layer's output."""
        rows = x.shape[0]
        attn = attn.reshape(rows, self.q_size)
        if attn.dtype != torch.float32 or attn.stride(1) != 1:
            attn = attn.float().contiguous()
        out = torch.empty(rows, self.dim)
        scratch = torch.empty(rows * (2 * self.dim + 3 * self.inter))
        proj, normed = scratch[: rows * self.dim], scratch[rows * self.dim: 2 * rows * self.dim]
        gu = scratch[2 * rows * self.dim: 2 * rows * self.dim + 2 * rows * self.inter]
        hidden = scratch[2 * rows * self.dim + 2 * rows * self.inter:]
        rc = self.lib.fm_layer_post(x.data_ptr(), attn.data_ptr(), attn.stride(0), rows, self.dim,
                                    self.o.ref, self.norm2.weight.data_ptr(), self.norm2.eps,
                                    self.gate_up.ref, self.down.ref, self.inter, proj.data_ptr(),
                                    normed.data_ptr(), gu.data_ptr(), hidden.data_ptr(),
                                    self._xq(rows).data_ptr(), out.data_ptr(),
                                    torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"the fused decode layer's o / MLP GEMV refused its weights "
                             f"(code {rc})")
        return out
