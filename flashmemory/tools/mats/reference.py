"""Dense causal attention in float64: what the cache's attention must equal when it reads every block exactly."""

from __future__ import annotations

import torch


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Attention of the new tokens' queries q [n, heads, D] (positions start .. start + n - 1) over keys and values
    k, v [start + n, kv_heads, D] of every token up to the last new one. Returns [n, heads, D] in float64."""
    n, heads, dim = q.shape
    total, kv_heads, _ = k.shape
    group = heads // kv_heads
    k = k.double().repeat_interleave(group, dim=1)  # [T, heads, D]
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,thd->hnt", q.double(), k) * dim**-0.5
    visible = torch.arange(total)[None, :] <= torch.arange(start, start + n)[:, None]  # [n, T]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hnt,thd->nhd", torch.softmax(scores, dim=-1), v)
