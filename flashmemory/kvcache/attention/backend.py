"""AttentionBackend: how a tiered forward's attention is computed over the blocks the read path chose.

A backend gets the query, the newest keys and values (the still-filling block and the tokens of this forward)
and, per level, the blocks to read (`LevelRead`); it reads them through the BlockReader (decoded into a buffer, or
as records straight from a pool) and returns the attention output. Backends are chosen by name in registry.py: a
CUDA kernel is one more file and one registry line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from flashmemory.kvcache.manager.blocks import Level
from flashmemory.kvcache.read.plan import LevelPlan

if TYPE_CHECKING:
    from flashmemory.kvcache.read.reader import BlockReader


@dataclass
class LevelRead:
    """The blocks one forward reads from one level at one layer."""

    level: Level
    plan: LevelPlan
    chosen: torch.Tensor | None  # [num_kv_heads, budget] positions into plan.indices per KV head; None = all


class AttentionBackend(Protocol):
    """Computes attention for the tiered cache (one sequence, one layer)."""

    name: str

    def decode(self, layer: int, q: torch.Tensor, filling: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor,
               reads: list[LevelRead], reader: BlockReader) -> torch.Tensor:
        """One decode token: q [1, num_heads, head_dim]; filling [2, num_kv_heads, m, head_dim] (the filling
        block's keys then values); new_k, new_v [num_kv_heads, 1, head_dim]. Returns [1, num_heads, head_dim]."""

    def prefill(self, layer: int, q: torch.Tensor, filling: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor,
                reads: list[LevelRead], reader: BlockReader) -> torch.Tensor:
        """A prefill chunk of n tokens: causal among the new tokens, every earlier block visible.
        q [n, num_heads, head_dim]; new_k, new_v [num_kv_heads, n, head_dim]. Returns [n, num_heads, head_dim]."""
