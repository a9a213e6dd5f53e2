"""ForwardPlanner: what a forward of the tiered cache reads, built once per sequence and once per
layer for the whole batch (as vLLM builds its attention metadata once per step).

At a sequence's first layer of a forward the read path plans its levels (the same blocks for every
layer); a prefill chunk under Quest notes the old blocks its last queries point to (prompt hints).
At every layer, the decode sequences of the forward become one DecodeBatch: their queries, rows and
level plans, with Quest's choice for all of them made in one pass where the digests live
(BlockReader.choose_batch).
"""

from __future__ import annotations

import torch

from flashmemory.errors import serving_sequence
from flashmemory.kvcache.attention.backend import DecodeBatch, LevelRead, SequenceDecode
from flashmemory.kvcache.config import KV_DTYPE, TieredCacheConfig
from flashmemory.kvcache.interface import SequenceSlice
from flashmemory.kvcache.manager.blocks import Level
from flashmemory.kvcache.read.reader import BlockReader
from flashmemory.kvcache.recent_rows import RecentRows
from flashmemory.kvcache.sequence_state import SequenceKV


class ForwardPlanner:
    """Builds a forward's reads from the cache's sequences, rows and read path (all shared)."""

    def __init__(self, cfg: TieredCacheConfig, reader: BlockReader, rows: RecentRows,
                 seqs: dict[int, SequenceKV]) -> None:
        self.cfg = cfg
        self.reader = reader
        self.rows = rows
        self.seqs = seqs  # the cache's live sequences (the same dict)

    def begin(self, layer: int, s: SequenceSlice, q: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> tuple[SequenceKV, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keep a slice's new keys and values for the commit; plan its reads at the forward's first
        layer. Returns the sequence, its row [2, num_kv_heads, m, head_dim] (sinks, recent blocks,
        filling) and the new keys and values [num_kv_heads, n, head_dim]."""
        # q: [n, num_heads, head_dim]; k, v: [n, num_kv_heads, head_dim]
        seq = self.seqs[s.seq_id]
        new_k = k.transpose(0, 1).to(KV_DTYPE)  # [num_kv_heads, n, head_dim]
        new_v = v.transpose(0, 1).to(KV_DTYPE)
        seq.pending.append((new_k, new_v))
        row = self.rows.layer_view(seq, layer)
        decoding = s.decoding
        quest = self.cfg.selection == "quest"
        if seq.plan is None:
            seq.plan = self.reader.plan(s.seq_id, seq, decoding, with_digest=quest)
            if decoding and quest and any(level != Level.DEVICE for level in seq.plan):
                self.reader.selection_steps += s.num_new_tokens  # each token reads as a step
            for level, plan in seq.plan.items():
                plan.hints = seq.hints.get(level) if decoding else None
            if not decoding:
                seq.hints = {}  # a new prompt chunk: the hints come from its own last tokens
        if quest and not decoding:
            for level, plan in seq.plan.items():
                hint = None if level == Level.DEVICE else self.reader.prompt_hints(plan, q, layer)
                if hint is not None:
                    seq.hints.setdefault(level, {})[layer] = hint
        return seq, row, new_k, new_v

    def decode_batch(self, layer: int, slices: list[SequenceSlice], q: torch.Tensor,
                     k: torch.Tensor, v: torch.Tensor) -> DecodeBatch:
        """One layer's DecodeBatch of decode slices: q [T, num_heads, head_dim], k, v [T,
        num_kv_heads, head_dim], the slices' tokens in order. A slice of n tokens (a verification,
        within its filling block: KVCache.max_decode_rows) gives n entries, token i's row holding
        the tokens before it, as the row of the decode step at its position would."""
        seqs, start = [], 0
        for s in slices:
            rows = slice(start, start + s.num_new_tokens)
            start += s.num_new_tokens
            with serving_sequence(s.seq_id):
                seq, row, new_k, new_v = self.begin(layer, s, q[rows], k[rows], v[rows])
            for i in range(s.num_new_tokens):
                reads = [LevelRead(level, plan, None) for level, plan in seq.plan.items()]
                token_row = row if i == 0 else torch.cat(  # with the tokens before it
                    (row, torch.stack((new_k[:, :i], new_v[:, :i]))), dim=2)
                seqs.append(SequenceDecode(s.seq_id, token_row, new_k[:, i : i + 1],
                                           new_v[:, i : i + 1], reads))
        if self.cfg.selection == "quest":
            old = [(b, read) for b, seq in enumerate(seqs) for read in seq.reads
                   if read.level != Level.DEVICE]
            wanted = [(b, read.level, read.plan) for b, read in old]
            for (_, read), positions in zip(old, self.reader.choose_batch(layer, q, wanted)):
                read.chosen = positions
        return DecodeBatch(layer, q, seqs)
