"""TorchAttention: the reference backend — every level's blocks decoded into one buffer, then torch's attention."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from flashmemory.kvcache.attention.backend import LevelRead
from flashmemory.kvcache.attention.dense import causal_attention
from flashmemory.kvcache.attention.partial import merge_partials, partial_attention

if TYPE_CHECKING:
    from flashmemory.kvcache.read.reader import BlockReader


class TorchAttention:
    """Decode: one buffer of all keys and values, one fused attention call. Prefill: partials merged by LSE."""

    name = "torch"

    def decode(self, layer: int, q: torch.Tensor, filling: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor,
               reads: list[LevelRead], reader: BlockReader) -> torch.Tensor:
        # One query sees every key it is given: write all levels' keys and values into one buffer (decoding
        # straight into it) and run a single fused attention — no causal mask, no partial results to merge.
        heads, head_dim, bs = filling.shape[1], filling.shape[3], reader.cfg.block_size
        compute = torch.promote_types(q.dtype, torch.float32)
        n_filling = filling.shape[2]
        sizes = [n_filling + 1] + [bs * (len(r.plan.indices) if r.chosen is None else r.chosen.shape[1])
                                   for r in reads]
        kv = torch.empty((2, heads, sum(sizes), head_dim), dtype=compute, device=q.device)  # K then V
        kv[:, :, :n_filling] = filling
        kv[0, :, n_filling : n_filling + 1] = new_k
        kv[1, :, n_filling : n_filling + 1] = new_v
        start = sizes[0]
        for read, size in zip(reads, sizes[1:]):
            reader.gather(read.level, read.plan, read.chosen, layer, compute, out=kv[:, :, start : start + size])
            start += size
        return causal_attention(q.to(compute), kv[0], kv[1], kv.shape[2] - 1).to(q.dtype)

    def prefill(self, layer: int, q: torch.Tensor, filling: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor,
                reads: list[LevelRead], reader: BlockReader) -> torch.Tensor:
        recent_k = torch.cat((filling[0], new_k), dim=1)
        recent_v = torch.cat((filling[1], new_v), dim=1)
        partials = [partial_attention(q, recent_k, recent_v, causal_offset=filling.shape[2])]
        for read in reads:
            kv = reader.gather(read.level, read.plan, read.chosen, layer, q.dtype)
            partials.append(partial_attention(q, kv[0], kv[1]))
        return merge_partials(partials).to(q.dtype)
