"""AttentionBackend: how a tiered forward's attention is computed over the blocks the read path chose.

Decode: once per layer, the backend gets every decode sequence of the forward in one DecodeBatch
(the queries, each sequence's newest keys and values, and per level the blocks to read,
`LevelRead`) and returns all their outputs. Prefill: one chunk of one sequence per call. It reads
blocks through the BlockReader (decoded into a buffer, or as records straight from a pool).
Backends are chosen by name in registry.py: a CUDA kernel is one more file and one registry line
(docs/architecture.md, "The attention seam", says what it implements).
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

    @property
    def num_blocks(self) -> int:
        """Blocks each KV head reads from the level."""
        return len(self.plan.indices) if self.chosen is None else self.chosen.shape[1]


@dataclass
class SequenceDecode:
    """One sequence of a DecodeBatch: its newest keys and values and what it reads per level."""

    seq_id: int
    # [2, num_kv_heads, m, head_dim] fp16 view: the sink, recent and filling tokens (K then V)
    row: torch.Tensor
    new_k: torch.Tensor  # [num_kv_heads, 1, head_dim] fp16: this step's key (a view)
    new_v: torch.Tensor  # [num_kv_heads, 1, head_dim] fp16
    reads: list[LevelRead]  # in level order; a level the sequence has no block on is absent

    def num_keys(self, block_size: int) -> int:
        """Keys each KV head attends to: the row's, the new one and block_size per block read."""
        return self.row.shape[2] + 1 + block_size * sum(r.num_blocks for r in self.reads)


@dataclass
class DecodeBatch:
    """Every decode sequence of one forward at one layer: one query token each, and its reads."""

    layer: int
    q: torch.Tensor  # [B, num_heads, head_dim] on the compute device; row b is seqs[b]'s query
    seqs: list[SequenceDecode]


class AttentionBackend(Protocol):
    """Computes the tiered cache's attention: a decode batch, or one prefill chunk, of a layer."""

    name: str

    def decode_batch(self, batch: DecodeBatch, reader: BlockReader) -> torch.Tensor:
        """One decode token per sequence, each attending to all it is given (no mask). Returns
        [B, num_heads, head_dim] in q's dtype, row b for batch.seqs[b]. Errors reading one
        sequence's blocks are raised within errors.serving_sequence(seq_id), so the engine fails or
        recomputes that sequence only."""

    def prefill(self, layer: int, q: torch.Tensor, filling: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor,
                reads: list[LevelRead], reader: BlockReader) -> torch.Tensor:
        """A prefill chunk of n tokens: causal among the new tokens, every earlier block visible.
        q [n, num_heads, head_dim]; new_k, new_v [num_kv_heads, n, head_dim]. Returns [n, num_heads, head_dim]."""
