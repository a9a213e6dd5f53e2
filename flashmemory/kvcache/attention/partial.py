"""Partial attention over one set of keys, returning output and log-sum-exp, and the exact merge of partials."""

from __future__ import annotations

import torch

# torch's fused CPU attention kernel also returns the log-sum-exp we need to merge partial results.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


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
    k, v = k.to(dtype), v.to(dtype)
    hidden = None
    if causal_offset is not None and n > 1:
        t = torch.arange(n, device=q.device).repeat(group)  # query row -> its token index
        hidden = torch.arange(m, device=q.device)[None, :] > (causal_offset + t)[:, None]  # [group * n, m]
    if _FLASH_CPU is not None and q.device.type == "cpu" and dtype == torch.float32:
        mask = None
        if hidden is not None:
            mask = torch.zeros(hidden.shape, dtype=dtype).masked_fill_(hidden, float("-inf"))[None, None]
        out, lse = _FLASH_CPU(qg.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask)
        out, lse = out[0], lse[0]  # [num_kv_heads, group * n, head_dim], [num_kv_heads, group * n]
    else:
        scores = torch.bmm(qg, k.transpose(1, 2)).mul_(head_dim**-0.5)  # [num_kv_heads, group * n, m]
        if hidden is not None:
            scores.masked_fill_(hidden, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # [num_kv_heads, group * n]
        out = torch.bmm(torch.exp(scores - lse.unsqueeze(-1)), v)  # [num_kv_heads, group * n, head_dim]
    out = out.reshape(num_kv_heads, group, n, head_dim).permute(2, 0, 1, 3).reshape(n, num_heads, head_dim)
    lse = lse.reshape(num_kv_heads, group, n).permute(2, 0, 1).reshape(n, num_heads)
    return out, lse


def merge_partials(partials: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Combine partial attentions over disjoint key sets into the attention over their union (exact)."""
    if len(partials) == 1:
        return partials[0][0]
    outs = torch.stack([o for o, _ in partials])  # [parts, n, num_heads, head_dim]
    lses = torch.stack([lse for _, lse in partials])  # [parts, n, num_heads]
    weights = torch.softmax(lses, dim=0)  # exp(lse_i - logsumexp(lse))
    return (outs * weights.unsqueeze(-1)).sum(dim=0)
