"""TorchAttention: the reference backend — every level's blocks decoded into one buffer, then torch's attention."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from flashmemory.errors import serving_sequence
from flashmemory.kvcache.attention.backend import DecodeBatch, LevelRead, SequenceDecode
from flashmemory.kvcache.attention.dense import causal_attention
from flashmemory.kvcache.attention.partial import merge_partials, partial_attention

if TYPE_CHECKING:
    from flashmemory.kvcache.read.reader import BlockReader


class TorchAttention:
    """Decode: one buffer of all keys and values, one fused attention call. Prefill: partials merged by LSE."""

    name = "torch"

    def decode_batch(self, batch: DecodeBatch, reader: BlockReader) -> torch.Tensor:
        # One query per sequence sees every key it is given: write all levels' keys and values into
        # one buffer (decoding straight into it) and run a single fused attention, no partial
        # results to merge. Several sequences share one buffer [B, 2, heads, longest, head_dim]
        # and one call, the padding masked.
        q, bs = batch.q, reader.cfg.block_size
        compute = torch.promote_types(q.dtype, torch.float32)
        heads, head_dim = batch.seqs[0].row.shape[1], batch.seqs[0].row.shape[3]
        if len(batch.seqs) == 1:
            seq = batch.seqs[0]
            kv = torch.empty((2, heads, seq.num_keys(bs), head_dim), dtype=compute,
                             device=q.device)
            self._fill(batch.layer, seq, kv, reader)
            return causal_attention(q.to(compute), kv[0], kv[1], kv.shape[2] - 1).to(q.dtype)
        num_keys = [seq.num_keys(bs) for seq in batch.seqs]
        longest = max(num_keys)
        kv = torch.zeros((len(num_keys), 2, heads, longest, head_dim), dtype=compute,
                         device=q.device)
        for b, seq in enumerate(batch.seqs):
            self._fill(batch.layer, seq, kv[b, :, :, : num_keys[b]], reader)
        lengths = torch.tensor(num_keys, device=q.device)[:, None]
        visible = torch.arange(longest, device=q.device) < lengths  # [B, longest]
        qg = q.to(compute).view(len(num_keys), heads, -1, head_dim)  # [B, heads, group, head_dim]
        out = F.scaled_dot_product_attention(qg, kv[:, 0], kv[:, 1],
                                             attn_mask=visible[:, None, None, :])
        return out.reshape(q.shape).to(q.dtype)

    @staticmethod
    def _fill(layer: int, seq: SequenceDecode, kv: torch.Tensor, reader: BlockReader) -> None:
        """Write a sequence's keys then values into kv [2, heads, num_keys, head_dim]: the row, the
        new token, then each level's blocks (decoded in place)."""
        n_row, bs = seq.row.shape[2], reader.cfg.block_size
        kv[:, :, :n_row] = seq.row
        kv[0, :, n_row : n_row + 1] = seq.new_k
        kv[1, :, n_row : n_row + 1] = seq.new_v
        start = n_row + 1
        with serving_sequence(seq.seq_id):
            for read in seq.reads:
                size = bs * read.num_blocks
                reader.gather(read.level, read.plan, read.chosen, layer, kv.dtype,
                              out=kv[:, :, start : start + size])
                start += size

    def prefill(self, layer: int, q: torch.Tensor, filling: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor,
                reads: list[LevelRead], reader: BlockReader) -> torch.Tensor:
        recent_k = torch.cat((filling[0], new_k), dim=1)
        recent_v = torch.cat((filling[1], new_v), dim=1)
        partials = [partial_attention(q, recent_k, recent_v, causal_offset=filling.shape[2])]
        for read in reads:
            kv = reader.gather(read.level, read.plan, read.chosen, layer, q.dtype)
            partials.append(partial_attention(q, kv[0], kv[1]))
        return merge_partials(partials).to(q.dtype)
