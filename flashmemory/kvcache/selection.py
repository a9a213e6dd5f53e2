"""Query-aware block selection (Quest): score blocks by an upper bound of q.k from per-channel key min/max."""

from __future__ import annotations

import torch


def select_blocks(q: torch.Tensor, digest: torch.Tensor, budget: int) -> torch.Tensor:
    """Pick, per KV head, the `budget` blocks whose keys can score highest against the query.

    q: [num_heads, head_dim] (one decode token); digest: [num_blocks, num_kv_heads, 2, head_dim] (min, max)
    returns indices into the blocks, [num_kv_heads, budget], ascending
    """
    num_blocks, num_kv_heads, _, head_dim = digest.shape
    group = q.shape[0] // num_kv_heads
    qg = q.float().view(1, num_kv_heads, group, head_dim)  # [1, heads, group, D]
    lo = digest[:, :, 0].unsqueeze(2)  # [blocks, heads, 1, D]
    hi = digest[:, :, 1].unsqueeze(2)
    # Upper bound of q.k for any key inside the box [lo, hi]: per channel, the larger of q*lo and q*hi.
    bound = torch.maximum(qg * lo, qg * hi).sum(-1)  # [blocks, heads, group]
    score = bound.amax(dim=-1).transpose(0, 1)  # [heads, blocks]: a block matters if any query head needs it
    chosen = torch.topk(score, budget, dim=-1).indices
    return chosen.sort(dim=-1).values
