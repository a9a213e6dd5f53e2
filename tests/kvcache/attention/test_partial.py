"""Partial attentions over disjoint key sets merge into exactly the attention over all keys."""

from __future__ import annotations

import torch

from flashmemory.kvcache.attention.dense import causal_attention
from flashmemory.kvcache.attention.partial import merge_partials, partial_attention


def test_merged_partials_equal_full_causal_attention():
    torch.manual_seed(0)
    n, past, hq, hkv, d = 5, 37, 6, 2, 16
    q = torch.randn(n, hq, d)
    k, v = torch.randn(hkv, past + n, d), torch.randn(hkv, past + n, d)
    full = causal_attention(q, k, v, num_cached_tokens=past)
    parts = [
        partial_attention(q, k[:, :10], v[:, :10]),
        partial_attention(q, k[:, 10:past], v[:, 10:past]),
        partial_attention(q, k[:, past:], v[:, past:], causal_offset=0),
    ]
    assert (merge_partials(parts) - full).abs().max() < 1e-5


def test_single_query_decode_merge():
    torch.manual_seed(1)
    q = torch.randn(1, 9, 64)
    k, v = torch.randn(3, 100, 64), torch.randn(3, 100, 64)
    full = causal_attention(q, k, v, num_cached_tokens=99)
    parts = [partial_attention(q, k[:, i : i + 25], v[:, i : i + 25]) for i in range(0, 100, 25)]
    assert (merge_partials(parts) - full).abs().max() < 1e-5


def test_fused_kernel_and_reference_path_agree():
    torch.manual_seed(2)
    q = torch.randn(7, 6, 32)
    k, v = torch.randn(2, 20, 32), torch.randn(2, 20, 32)
    fast = partial_attention(q, k, v, causal_offset=13)
    slow = partial_attention(q.double(), k.double(), v.double(), causal_offset=13)  # float64: reference path
    assert (fast[0] - slow[0]).abs().max() < 1e-5 and (fast[1] - slow[1]).abs().max() < 1e-5
