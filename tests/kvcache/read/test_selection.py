"""Quest selection: the bound really bounds every key of a block, and the best block is always chosen."""

from __future__ import annotations

import torch

from flashmemory.kvcache.read.selection import (block_scores, key_digest, rescore_blocks,
                                                select_blocks)


def test_block_holding_the_best_matching_key_is_always_selected():
    torch.manual_seed(0)
    keys = torch.randn(2, 40, 16, 32)  # [kv heads, blocks, tokens, D]
    q = torch.randn(6, 32)  # 3 query heads per KV head
    target = 17
    keys[:, target, 5] = q.view(2, 3, 32)[:, 0] * 3  # a key aligned with a query head, in block 17
    chosen = select_blocks(q, key_digest(keys), budget=4)
    assert chosen.shape == (2, 4)
    assert (chosen == target).any(dim=1).all()
    assert (chosen.diff(dim=1) > 0).all()  # ascending, no duplicates


def test_bound_is_quests_min_max_bound_and_bounds_every_score():
    torch.manual_seed(1)
    keys = torch.randn(1, 10, 16, 8)  # [kv heads, blocks, tokens, D]
    q = torch.randn(2, 8)
    lo, hi = keys.amin(2), keys.amax(2)  # [1, b, D]
    quest = torch.maximum(q[:, None, None] * lo, q[:, None, None] * hi).sum(-1).amax(0)  # [1, b]
    bound = block_scores(q, key_digest(keys))
    torch.testing.assert_close(bound, quest, rtol=1e-5, atol=1e-5)
    scores = torch.einsum("hbtd,gd->hbtg", keys, q).amax(dim=(2, 3))  # best real score per block
    assert (scores <= bound + 1e-5).all()
    ranked = torch.argsort(quest[0], descending=True)[:3].sort().values
    assert torch.equal(select_blocks(q, key_digest(keys), 3)[0], ranked)


def test_a_block_with_boxes_scores_as_its_best_box_and_never_above_one_box():
    torch.manual_seed(7)
    keys = torch.randn(2, 12, 16, 32)  # [kv_heads, blocks, tokens, D]
    keys[:, 5, :8] += 3.0  # one half of a block points one way, the other half another
    keys[:, 5, 8:] -= 3.0
    q = torch.randn(6, 32)  # 3 query heads per KV head
    one_box, four_boxes = block_scores(q, key_digest(keys)), block_scores(q, key_digest(keys, 4))
    assert bool((four_boxes <= one_box + 1e-5).all())  # a box inside the block's box bounds no higher
    per_box = torch.stack([block_scores(q, key_digest(keys[:, :, i * 4:(i + 1) * 4])) for i in range(4)])
    torch.testing.assert_close(four_boxes, per_box.amax(dim=0))
    # Every key's own score is still under its block's bound: the boxes cover every key.
    exact = torch.einsum("hgd,hbtd->hbtg", q.view(2, 3, 32), keys).amax(dim=(-1, -2))
    assert bool((exact <= four_boxes + 1e-4).all())
    assert key_digest(keys, 4).shape == (2, 12, 4 * 2 * 32) and key_digest(keys, 16).shape == (2, 12, 64)


def test_the_second_pass_keeps_the_blocks_with_the_most_attention_mass():
    torch.manual_seed(3)
    keys = torch.randn(2, 10, 8, 16) * 0.1  # [kv heads, candidates, tokens, D]
    q = torch.randn(4, 16)  # 2 query heads per KV head
    # Candidate 2: one key a little aligned. Candidate 6: every key aligned, less each: more mass in
    # all.
    keys[:, 2, 0] = q.view(2, 2, 16)[:, 0] * 0.6
    keys[:, 6] = (q.view(2, 2, 16)[:, 1] * 0.4)[:, None]
    chosen = rescore_blocks(q, keys, budget=2)
    logits = torch.einsum("hgd,hctd->hgct", q.view(2, 2, 16), keys) / 4
    # [heads, c]: the weight it takes
    mass = logits.flatten(2).softmax(-1).view(2, 2, 10, 8).sum(-1).amax(1)
    assert torch.equal(chosen, mass.topk(2).indices.sort().values)
    assert (chosen == 6).any(dim=1).all()
    kept = torch.zeros(2, 10, dtype=torch.bool)
    kept[:, 9] = True  # a prompt hint stays, whatever it scores
    assert (rescore_blocks(q, keys, 2, kept) == 9).any(dim=1).all()
