"""RoPE tables are built lazily in 512-position shards: memory follows the positions used, never seq^2."""

from __future__ import annotations

import torch

from flashmemory.model.rope import SHARD_POSITIONS, RotaryEmbedding


def test_tables_grow_by_shards_only_as_positions_are_reached():
    rope = RotaryEmbedding(64, 10000.0, None, 8192, torch.device("cpu"))
    assert rope.num_cached_positions == 0
    rope.cos_sin(torch.arange(10), 9)
    assert rope.num_cached_positions == SHARD_POSITIONS
    rope.cos_sin(torch.tensor([1500]), 1500)
    assert rope.num_cached_positions == 3 * SHARD_POSITIONS


def test_rotation_preserves_norm_and_relative_position():
    rope = RotaryEmbedding(64, 10000.0, None, 8192, torch.device("cpu"))
    q, k = torch.randn(1, 1, 64), torch.randn(1, 1, 64)

    def rotated_dot(pq: int, pk: int) -> float:
        cq, sq = rope.cos_sin(torch.tensor([pq]), pq)
        ck, sk = rope.cos_sin(torch.tensor([pk]), pk)
        return float((RotaryEmbedding.apply(q, cq, sq) * RotaryEmbedding.apply(k, ck, sk)).sum())

    cos, sin = rope.cos_sin(torch.tensor([700]), 700)
    assert torch.allclose(RotaryEmbedding.apply(q, cos, sin).norm(), q.norm(), atol=1e-5)
    assert abs(rotated_dot(10, 3) - rotated_dot(1010, 1003)) < 1e-3
