"""Attention kernels over cached keys and values (grouped-query, causal, optional sliding window)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    num_cached_tokens: int,
    sliding_window_tokens: int | None = None,
) -> torch.Tensor:
    """Attention of new queries over a sequence's keys, the new ones last.

    q: [n, num_heads, head_dim] for positions num_cached_tokens .. num_cached_tokens + n - 1
    k, v: [num_kv_heads, num_cached_tokens + n, head_dim]
    returns [n, num_heads, head_dim]
    """
    n, num_heads, head_dim = q.shape
    num_kv_heads, total, _ = k.shape
    group = num_heads // num_kv_heads
    window_cuts = sliding_window_tokens is not None and total > sliding_window_tokens
    if n == 1 and not window_cuts:
        # Decode: every cached key is visible, so the queries of one KV group stack into one matrix
        # and no mask (and no repeat of K/V per query head) is needed.
        # 4-D inputs select torch's fused CPU kernel (2x faster here than the 3-D math path).
        qg = q.view(1, num_kv_heads, group, head_dim)  # [1, num_kv_heads, group, head_dim]
        out = F.scaled_dot_product_attention(qg, k.unsqueeze(0), v.unsqueeze(0))  # [1, num_kv_heads, group, head_dim]
        return out.reshape(1, num_heads, head_dim)
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, num_heads, n, head_dim]
    kh, vh = k.unsqueeze(0), v.unsqueeze(0)  # [1, num_kv_heads, total, head_dim]
    if num_cached_tokens == 0 and not window_cuts:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=group > 1)
    else:
        query_pos = torch.arange(num_cached_tokens, num_cached_tokens + n, device=q.device)[:, None]
        key_pos = torch.arange(total, device=q.device)[None, :]
        mask = key_pos <= query_pos  # [n, total]
        if sliding_window_tokens is not None:
            mask &= key_pos > query_pos - sliding_window_tokens
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=group > 1)
    return out.squeeze(0).transpose(0, 1)  # [n, num_heads, head_dim]
