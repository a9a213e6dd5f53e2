"""A QuantizedLinear's decode GEMV as one native call (csrc/projection.c's fm_project): its parts'
formats, blocks and output columns and its bias, kept as the C struct the call takes, for
QuantizedLinear's decode path and the fused decode layer (decode_layer.py) alike."""

from __future__ import annotations

import ctypes

import torch

from flashmemory.model.native import quant_kernels

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


class _Part(ctypes.Structure):
    _fields_ = [("int8", _I64), ("type", _I64), ("blocks", _PTR), ("rows", _I64), ("cols", _I64),
                ("row_bytes", _I64), ("start", _I64)]


class _Proj(ctypes.Structure):
    _fields_ = [("parts", ctypes.POINTER(_Part)), ("num_parts", _I64), ("out_features", _I64),
                ("bias", _PTR), ("x8_layouts", _I64)]


def declare(lib: ctypes.CDLL) -> None:
    lib.fm_project.restype = _INT
    lib.fm_project.argtypes = [_PTR, _PTR, _I64, _I64, _PTR, _PTR, _INT]


class NativeProjection:
    """Parts as (8-bit x, GGUF type id, blocks tensor, cols, first output column); `ref` is what
    fm_project and the fused layer's calls take (valid while this object lives)."""

    def __init__(self, lib: ctypes.CDLL, parts: list[tuple[bool, int, torch.Tensor, int, int]],
                 out_features: int, bias: torch.Tensor | None) -> None:
        declare(lib)
        self.lib = lib
        self._blocks = [blocks for _, _, blocks, _, _ in parts]  # what the struct points into
        self.parts = (_Part * len(parts))(*(
            _Part(int(int8), type_id, blocks.data_ptr(), blocks.shape[0], cols, blocks.shape[1],
                  start) for int8, type_id, blocks, cols, start in parts))
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.x8_layouts = quant_kernels.x8_layouts(lib, [t for int8, t, *_ in parts if int8])
        self.cols, self.out_features = parts[0][3], out_features
        self.describe = ", ".join(f"type {type_id}: {blocks.shape[0]} x {cols}"
                                  for _, type_id, blocks, cols, _ in parts)
        self.struct = _Proj(self.parts, len(parts), out_features,
                            None if self.bias is None else self.bias.data_ptr(), self.x8_layouts)
        self.ref = ctypes.byref(self.struct)

    def project(self, x: torch.Tensor, xq: torch.Tensor, out: torch.Tensor) -> None:
        """out [n, out_features] = x [n, cols] W^T (+ b); xq: room for n rows of 8-bit x."""
        rc = self.lib.fm_project(self.ref, x.data_ptr(), x.shape[0], x.stride(0), xq.data_ptr(),
                                 out.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"the decode GEMV refused a weight of this projection "
                             f"({self.describe}; code {rc})")
