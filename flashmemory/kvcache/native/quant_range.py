"""The "mse" range of KV quantization through the native kernel (csrc/quant_range.c): every group's shrink factor
chosen in one pass, where the torch loop in kvcache/quant.py (the reference and the fallback) runs ~10 ops per
factor over the block."""

from __future__ import annotations

import ctypes

import torch

from flashmemory.kvcache.native.loader import MAX_RANGE_FACTORS, library


def native_quant_range(xg: torch.Tensor, axis: int, bits: int,
                       shrink: tuple[float, ...]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """fp16 (scale, zero) of each group of xg, shaped as the group axis reduced with keepdim; None where the kernel
    cannot run (the caller then runs the torch loop).

    xg: float32 contiguous CPU [..., groups, group, D] (axis -2: a channel over `group` tokens) or
    [..., T, groups, group] (axis -1: `group` channels of one token), as `quant._grouped` views it.
    """
    lib = library() if xg.device.type == "cpu" else None
    if (lib is None or xg.dtype != torch.float32 or not xg.is_contiguous() or xg.dim() < 2
            or not 1 <= len(shrink) <= MAX_RANGE_FACTORS or bits not in (2, 4)):
        return None
    if axis == -2:
        group, inner = xg.shape[-2], xg.shape[-1]
        out_shape = (*xg.shape[:-2], 1, inner)
    else:
        group, inner = xg.shape[-1], 1
        out_shape = (*xg.shape[:-1], 1)
    outer = xg.numel() // (group * inner)
    scale = torch.empty(out_shape, dtype=torch.float16)
    zero = torch.empty(out_shape, dtype=torch.float16)
    factors = (ctypes.c_float * len(shrink))(*shrink)
    rc = lib.fm_quant_range(xg.data_ptr(), outer, group, inner, bits, factors, len(shrink), scale.data_ptr(),
                            zero.data_ptr())
    return (scale, zero) if rc == 0 else None
