"""Prompt hints: the old blocks a prompt's last tokens point to, kept in every decode step's choice.

A decode step scores blocks with one query, the token being generated; in the first steps of an answer that
token ("The", "is", a digit) says little about which fact is asked for, while the prompt's last tokens (the
question) do. So the last prefill chunk scores the old (L1 / L2) blocks with its final queries, and the
best `k` per layer and KV head are read at every decode step that follows (inside the level's budget).
"""

from __future__ import annotations

import torch

from flashmemory.kvcache.read.selection import block_scores

HINT_QUERIES = 16  # a prefill chunk's last tokens that score the hints (about a question's length)


def prompt_hints(q: torch.Tensor, digest: torch.Tensor, indices: torch.Tensor, k: int) -> torch.Tensor:
    """Logical indices [num_kv_heads, min(k, n)] of the blocks the chunk's last queries score highest.

    q: [n_tokens, num_heads, head_dim] (a prefill chunk); digest: [num_kv_heads, n, 2 * head_dim] of one layer;
    indices: [n] logical block indices of the digest's blocks
    """
    last = q[-HINT_QUERIES:]
    digest = digest.float()  # once, not per query (a sequence stores its digests in fp16)
    # Scores of the queries one after another, then the largest: a block any of them points to counts.
    scores = torch.stack([block_scores(token, digest) for token in last]).amax(dim=0)  # [heads, n]
    top = torch.topk(scores, min(k, scores.shape[1]), dim=-1, sorted=False).indices
    return indices.to(top.device)[top]


def boost_hints(scores: torch.Tensor, indices: torch.Tensor, hints: torch.Tensor) -> torch.Tensor:
    """Scores [heads, n] with the hinted blocks raised above every other (to +inf).

    indices: [n] logical indices of the scored blocks, ascending; hints: [heads, k] logical indices (some may
    be gone from this level since, e.g. moved to L2: they are simply not found).
    """
    indices = indices.to(scores.device)
    hints = hints.to(scores.device)
    pos = torch.searchsorted(indices, hints).clamp_(max=indices.shape[0] - 1)  # [heads, k]
    found = indices[pos] == hints
    # A hint not on this level points at some other block: that block's own score goes back (the largest wins
    # where two hints point at one block).
    lifted = torch.where(found, torch.full_like(scores[:, :1], float("inf")), scores.gather(1, pos))
    return scores.scatter_reduce(1, pos, lifted, reduce="amax")
