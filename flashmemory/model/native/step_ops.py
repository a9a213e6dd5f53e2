"""The fused per-layer operations of csrc/step_ops.c for float32 CPU tensors; None from each when it cannot run
(no native library, another dtype or device, a layout it does not take), and the caller uses torch."""

from __future__ import annotations

import torch

from flashmemory.model.native import quant_kernels


def _runs_here(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors) \
        and quant_kernels.library() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """x [T, dim] (rows contiguous) -> x * rsqrt(mean(x^2) + eps) * weight."""
    if x.dim() != 2 or x.stride(1) != 1 or not weight.is_contiguous() or not _runs_here(x, weight):
        return None
    out = torch.empty(x.shape)
    quant_kernels.library().fm_rmsnorm(x.data_ptr(), x.stride(0), weight.data_ptr(), x.shape[0], x.shape[1], eps,
                                       out.data_ptr())
    return out


def _rope_layout(x: torch.Tensor) -> bool:
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotate q [T, Hq, D] and k [T, Hk, D] in place (heads contiguous within a token) by cos/sin [T, D]; both or
    neither (False: the caller rotates them with torch)."""
    if not (_rope_layout(q) and _rope_layout(k) and cos.is_contiguous() and sin.is_contiguous()
            and _runs_here(q, k, cos, sin)):
        return False
    lib = quant_kernels.library()
    for x in (q, k):
        lib.fm_rope(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], x.shape[2], cos.data_ptr(), sin.data_ptr())
    return True


def swiglu(gate_up: torch.Tensor) -> torch.Tensor | None:
    """gate_up [T, 2I] (contiguous) -> silu(gate) * up [T, I]."""
    if gate_up.dim() != 2 or not gate_up.is_contiguous() or not _runs_here(gate_up):
        return None
    inter = gate_up.shape[1] // 2
    out = torch.empty(gate_up.shape[0], inter)
    quant_kernels.library().fm_swiglu(gate_up.data_ptr(), gate_up.shape[0], inter, out.data_ptr())
    return out
