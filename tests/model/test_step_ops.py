"""The fused step operations (RMSNorm, RoPE, SwiGLU) equal the torch reference to float summation error, and step
aside (None / False) where they do not run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flashmemory.model.native import quant_kernels, step_ops
from flashmemory.model.rope import RotaryEmbedding

pytestmark = pytest.mark.skipif(quant_kernels.library() is None, reason="no C compiler: the native kernels are absent")


def test_fused_rms_norm_equals_torch():
    x, w = torch.randn(5, 576), torch.randn(576)
    reference = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(step_ops.rms_norm(x, w, 1e-5), reference, rtol=1e-5, atol=1e-6)


def test_fused_rope_rotates_q_and_k_in_place_as_torch_does():
    qkv = torch.randn(3, (9 + 2 * 3) * 64)
    q, k, _ = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
    q, k = q.view(3, 9, 64), k.view(3, 3, 64)
    cos, sin = torch.randn(3, 64), torch.randn(3, 64)
    expected_q, expected_k = RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin)
    assert step_ops.rope_(q, k, cos, sin)
    torch.testing.assert_close(q, expected_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k, expected_k, rtol=1e-6, atol=1e-6)


def test_fused_swiglu_equals_torch():
    gate_up = torch.randn(4, 2 * 1536) * 4
    gate, up = gate_up.split(1536, dim=-1)
    torch.testing.assert_close(step_ops.swiglu(gate_up), F.silu(gate) * up, rtol=1e-5, atol=1e-6)


def test_other_dtypes_are_left_to_torch():
    x = torch.randn(2, 64, dtype=torch.float64)
    assert step_ops.rms_norm(x, torch.ones(64, dtype=torch.float64), 1e-5) is None
    assert step_ops.swiglu(x) is None
    q = torch.randn(2, 4, 16, dtype=torch.bfloat16)
    assert not step_ops.rope_(q, q, torch.randn(2, 16), torch.randn(2, 16))
