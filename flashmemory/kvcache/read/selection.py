"""Query-aware block selection (Quest): score blocks by an upper bound of q.k from per-channel key min/max.

A block's digest stores, per channel, the centre and the radius of the keys' [min, max] box. The largest q.k
any key in the box can reach is sum_c max(q_c min_c, q_c max_c) = q . centre + |q| . radius, so scoring every
block of a level is one batched matrix product per KV head instead of a pass over a 4-D tensor.

A block may have several boxes, each over `box_tokens` consecutive keys (`selection_box_tokens`): the block's
bound is then the largest of its boxes' bounds, never looser than one box over the block and tighter where the
keys of its halves point different ways. Digest row: the boxes one after another, each centre then radius.
A sequence keeps its digests in DIGEST_DTYPE (fp16: half the memory of float32; a bound rounded by 2**-11 of
its size ranks blocks as the float32 one does but for near-ties); scores are computed in float32.
"""

from __future__ import annotations

import torch

DIGEST_DTYPE = torch.float16  # how a sequence stores its digests (sequence_state.py)


def key_digest(keys: torch.Tensor, box_tokens: int = 0) -> torch.Tensor:
    """keys [..., tokens, head_dim] -> digest [..., boxes * 2 * head_dim] (float32): per box of `box_tokens`
    consecutive keys (0: one box over all of them), the centre then the radius of each channel."""
    *lead, tokens, head_dim = keys.shape
    boxes = tokens // box_tokens if 0 < box_tokens < tokens else 1
    lo, hi = keys.float().reshape(*lead, boxes, tokens // boxes, head_dim).aminmax(dim=-2)
    return torch.cat(((hi + lo) * 0.5, (hi - lo) * 0.5), dim=-1).reshape(*lead, boxes * 2 * head_dim)


def block_scores(q: torch.Tensor, digest: torch.Tensor) -> torch.Tensor:
    """Upper bound of q.k over each block's keys, the largest over the query heads sharing a KV head.

    q: [num_heads, head_dim] (one decode token); digest: [num_kv_heads, num_blocks, boxes * 2 * head_dim]
    returns [num_kv_heads, num_blocks]
    """
    num_kv_heads, num_blocks, width = digest.shape
    group, box_width = q.shape[0] // num_kv_heads, 2 * q.shape[1]
    boxes = width // box_width
    q, digest = q.float(), digest.float()
    q_ext = torch.cat((q, q.abs()), dim=-1).view(num_kv_heads, group, box_width)  # [heads, group, 2D]
    if boxes == 1:
        return torch.bmm(digest, q_ext.transpose(1, 2)).amax(dim=-1)  # [heads, blocks]
    per_box = torch.bmm(digest.reshape(num_kv_heads, num_blocks * boxes, box_width), q_ext.transpose(1, 2))
    return per_box.view(num_kv_heads, num_blocks, boxes * group).amax(dim=-1)


def select_blocks(q: torch.Tensor, digest: torch.Tensor, budget: int) -> torch.Tensor:
    """Pick, per KV head, the `budget` blocks whose keys can score highest against the query.

    q: [num_heads, head_dim]; digest: [num_kv_heads, num_blocks, 2 * head_dim] (see `key_digest`)
    returns indices into the blocks, [num_kv_heads, budget], ascending
    """
    return top_blocks(block_scores(q, digest), budget)


def top_blocks(scores: torch.Tensor, budget: int) -> torch.Tensor:
    """The `budget` highest-scoring blocks per KV head: scores [num_kv_heads, num_blocks] -> indices, ascending.

    Ties go to the lower block index (a stable sort; topk picks among equals in no documented order), the rule the
    native kernel (kvcache/native/csrc/quest_select.c) follows too."""
    chosen = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :budget]
    return chosen.sort(dim=-1).values


def rescore_blocks(q: torch.Tensor, keys: torch.Tensor, budget: int,
                   keep: torch.Tensor | None = None) -> torch.Tensor:
    """The second pass of a two-pass read: among candidate blocks the bounds picked, the `budget`
    whose keys take the most attention.

    q: [num_heads, head_dim] (one decode token); keys: [num_kv_heads, c, block_size, head_dim] of
    the c candidates per KV head; keep: [num_kv_heads, c] bool, candidates kept whatever they score
    (prompt hints). Returns positions into the candidates, [num_kv_heads, budget], ascending.
    """
    return top_rescored(rescore_scores(q, keys), budget, keep)


def top_rescored(scores: torch.Tensor, budget: int, keep: torch.Tensor | None) -> torch.Tensor:
    """The `budget` best of rescore_scores' [num_kv_heads, c], the `keep` ones first."""
    if keep is not None:
        scores = scores.masked_fill(keep, float("inf"))
    return top_blocks(scores, budget)


def rescore_scores(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """[num_kv_heads, c]: a block's mass for a query head is the softmax weight its keys take among
    all candidates' keys (in log); it scores as its largest over the query heads sharing the KV
    head (the native kernel, kvcache/native/csrc/block_rescore.c, computes the same)."""
    num_kv_heads, c, bs, head_dim = keys.shape
    group = q.shape[0] // num_kv_heads
    qg = q.float().view(num_kv_heads, group, head_dim) * head_dim**-0.5
    logits = torch.matmul(qg, keys.float().reshape(num_kv_heads, c * bs, head_dim).transpose(1, 2))
    per_block = logits.view(num_kv_heads, group, c, bs).logsumexp(dim=-1)  # [heads, group, c]
    share = per_block - per_block.logsumexp(dim=-1, keepdim=True)  # log of each block's weight
    return share.amax(dim=1)  # [heads, c]
