"""Quest selection: the bound really bounds every key of a block, and the best block is always chosen."""

from __future__ import annotations

import torch

from flashmemory.kvcache.selection import select_blocks


def _digest(keys: torch.Tensor) -> torch.Tensor:
    # keys: [blocks, heads, tokens, D] -> [blocks, heads, 2, D]
    return torch.stack((keys.amin(2), keys.amax(2)), dim=2)


def test_block_holding_the_best_matching_key_is_always_selected():
    torch.manual_seed(0)
    keys = torch.randn(40, 2, 16, 32)
    q = torch.randn(6, 32)  # 3 query heads per KV head
    target = 17
    keys[target, :, 5] = q.view(2, 3, 32)[:, 0] * 3  # a key aligned with a query head, in block 17
    chosen = select_blocks(q, _digest(keys), budget=4)
    assert chosen.shape == (2, 4)
    assert (chosen == target).any(dim=1).all()
    assert (chosen.diff(dim=1) > 0).all()  # ascending, no duplicates


def test_bound_is_an_upper_bound_of_every_score():
    torch.manual_seed(1)
    keys = torch.randn(10, 1, 16, 8)
    q = torch.randn(2, 8)
    d = _digest(keys)
    lo, hi = d[:, :, 0], d[:, :, 1]
    bound = torch.maximum(q[None, None] * lo[:, :, None], q[None, None] * hi[:, :, None]).sum(-1)  # [b, 1, 2]
    scores = torch.einsum("bhtd,gd->bhtg", keys, q).amax(2)  # [b, 1, 2]
    assert (scores <= bound + 1e-5).all()
    # select_blocks ranks by exactly this bound (max over the query heads of the group).
    ranked = torch.argsort(bound.amax(-1)[:, 0], descending=True)[:3].sort().values
    assert torch.equal(select_blocks(q, d, 3)[0], ranked)
