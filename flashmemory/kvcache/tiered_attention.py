"""Partial attention over one set of keys, returning output and log-sum-exp, and the exact merge of partials."""

from __future__ import annotations

import torch


def partial_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_offset: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over one key set, unnormalised across sets.

    q: [n, num_heads, head_dim]; k, v: [num_kv_heads, m, head_dim] (m keys, the same for every query)
    causal_offset: when given, query t sees key j only if j <= causal_offset + t (keys are the newest tokens)
    returns out [n, num_heads, head_dim] and lse [n, num_heads], in float32 (float64 if q is float64)
    """
    n, num_heads, head_dim = q.shape
    num_kv_heads, m, _ = k.shape
    group = num_heads // num_kv_heads
    dtype = torch.promote_types(q.dtype, torch.float32)  # never accumulate below float32
    # Stack the queries of a KV group so K/V are read once per KV head: [num_kv_heads, group * n, head_dim]
    qg = q.to(dtype).view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(num_kv_heads, group * n, head_dim)
    scores = torch.bmm(qg, k.to(dtype).transpose(1, 2)).mul_(head_dim**-0.5)  # [num_kv_heads, group * n, m]
    if causal_offset is not None and n > 1:
        t = torch.arange(n, device=q.device).repeat(group)  # query row -> its token index
        hidden = torch.arange(m, device=q.device)[None, :] > (causal_offset + t)[:, None]  # [group * n, m]
        scores.masked_fill_(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [num_kv_heads, group * n]
    out = torch.bmm(torch.exp(scores - lse.unsqueeze(-1)), v.to(dtype))  # [num_kv_heads, group * n, head_dim]
    out = out.view(num_kv_heads, group, n, head_dim).permute(2, 0, 1, 3).reshape(n, num_heads, head_dim)
    lse = lse.view(num_kv_heads, group, n).permute(2, 0, 1).reshape(n, num_heads)
    return out, lse


def merge_partials(partials: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Combine partial attentions over disjoint key sets into the attention over their union (exact)."""
    if len(partials) == 1:
        return partials[0][0]
    outs = torch.stack([o for o, _ in partials])  # [parts, n, num_heads, head_dim]
    lses = torch.stack([lse for _, lse in partials])  # [parts, n, num_heads]
    weights = torch.softmax(lses, dim=0)  # exp(lse_i - logsumexp(lse))
    return (outs * weights.unsqueeze(-1)).sum(dim=0)
