"""RecentRows: every live sequence's newest tokens (and its attention sinks), unquantized (FP16) in device memory.

A row holds the still-filling block and, when `recent_tokens` > 0, the last full blocks and the attention-sink
blocks as well. Those blocks are written to the levels like any other (an INT4 L0 copy, the FP16 L1 master,
names for the prefix cache), but a forward attends them here, in FP16, instead of through their INT4 L0 copy:
the newest tokens and the sinks are the ones a step attends most, so they are the ones rounding hurts most
(KIVI keeps such a full-precision residual of recent tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashmemory.errors import CapacityError
from flashmemory.kvcache.config import KV_DTYPE
from flashmemory.kvcache.sequence_state import SequenceKV


@dataclass
class RowAppend:
    """What one commit did to a sequence's row."""

    full_k: torch.Tensor  # [num_layers, heads, blocks * block_size, head_dim]: blocks completed by this commit
    full_v: torch.Tensor
    num_blocks: int  # blocks completed (to write to the levels, oldest first)
    old_partial: int  # tokens of the filling block before this commit (the first block's tokens not new)


def recent_capacity(recent_tokens: int, block_size: int, active_window: int) -> int:
    """Full-block tokens a row keeps besides its filling block: `recent_tokens` rounded up to whole blocks, at most
    the window's (the row stands in for L0 copies only, never for L1 or L2 reads)."""
    return min(-(-recent_tokens // block_size), active_window // block_size) * block_size


def row_layout(recent_fp16_tokens: int, block_size: int, active_window: int, num_sink_blocks: int,
               device_bits: int) -> tuple[int, int]:
    """(recent, sink) full-block tokens a row keeps: none when L0 is FP16 anyway or recent_fp16_tokens is 0."""
    if device_bits >= 16 or recent_fp16_tokens <= 0:
        return 0, 0
    return recent_capacity(recent_fp16_tokens, block_size, active_window), num_sink_blocks * block_size


class RecentRows:
    """Owns the arena of rows [max_num_seqs, 2, num_layers, heads, sink + recent + block_size, head_dim] and which are
    free. A row holds, oldest first: the attention-sink blocks once full (`sink` tokens), the newest full blocks
    (up to `recent` tokens), then the still-filling block."""

    def __init__(self, max_num_seqs: int, num_layers: int, num_kv_heads: int, block_size: int, head_dim: int,
                 recent_tokens: int, sink_tokens: int, device: torch.device) -> None:
        """recent_tokens, sink_tokens: full-block tokens kept (multiples of block_size; see `recent_capacity`)."""
        self.block_size = block_size
        self.recent, self.sink = recent_tokens, sink_tokens
        self.arena = torch.zeros((max_num_seqs, 2, num_layers, num_kv_heads, sink_tokens + recent_tokens + block_size,
                                  head_dim), dtype=KV_DTYPE, device=device)
        self._free = list(range(max_num_seqs))

    # ---- rows -------------------------------------------------------------------------------------------------

    def take(self) -> int:
        if not self._free:
            raise CapacityError(f"{self.arena.shape[0]} sequences are already alive (max_num_seqs); finish one or "
                                "raise max_num_seqs")
        return self._free.pop()

    def give_back(self, row: int) -> None:
        self._free.append(row)

    def layer_view(self, seq: SequenceKV, layer: int) -> torch.Tensor:
        """The sequence's row for one layer: [2, heads, num_filling, head_dim] (sink, recent, filling)."""
        return self.arena[seq.filling_row, :, layer, :, : seq.num_filling]

    @property
    def row_bytes(self) -> int:
        return self.arena[0].numel() * self.arena.element_size()

    @property
    def nbytes(self) -> int:
        return self.arena.numel() * self.arena.element_size()

    def load(self, seq: SequenceKV, sink: torch.Tensor, recent: torch.Tensor) -> None:
        """Fill an empty sequence's row with the full blocks it starts with (a reused prefix's sink and newest
        blocks): each [2, num_layers, heads, tokens, head_dim], whole blocks, within the row's sink and recent."""
        ns, nr = sink.shape[3], recent.shape[3]
        if seq.num_filling or ns % self.block_size or nr % self.block_size or ns > self.sink or nr > self.recent:
            raise ValueError(f"cannot load {ns} + {nr} tokens into a row holding {seq.num_filling} "
                             f"(sink {self.sink}, recent {self.recent})")
        self.arena[seq.filling_row, :, :, :, :ns] = sink
        self.arena[seq.filling_row, :, :, :, ns : ns + nr] = recent
        seq.num_sink, seq.num_recent, seq.num_filling = ns, nr, ns + nr

    # ---- commit -----------------------------------------------------------------------------------------------

    def append(self, seq: SequenceKV, new_k: torch.Tensor, new_v: torch.Tensor, blocks_before: int) -> RowAppend:
        """Add a forward's keys and values [num_layers, heads, n, head_dim] to the sequence's row (which has
        `blocks_before` full blocks); returns the blocks they completed. Completed sink blocks stay in the row for
        good; of the others the row keeps the newest `recent` tokens' worth, and the rest of a block."""
        bs, row = self.block_size, self.arena[seq.filling_row]
        n = new_k.shape[2]
        base = seq.num_sink
        old_partial = seq.num_partial
        full = (old_partial + n) // bs
        if full == 0:  # the common decode step: the token goes into place
            row[0, :, :, seq.num_filling : seq.num_filling + n] = new_k
            row[1, :, :, seq.num_filling : seq.num_filling + n] = new_v
            seq.num_filling += n
            empty = new_k[:, :, :0]
            return RowAppend(empty, empty, 0, old_partial)
        region_k = torch.cat((row[0, :, :, base : seq.num_filling], new_k), dim=2)  # [recent | partial | new]
        region_v = torch.cat((row[1, :, :, base : seq.num_filling], new_v), dim=2)
        start, total = seq.num_recent, region_k.shape[2]
        # Completed blocks that are sink blocks (only while no recent block exists yet: start == 0).
        sinks = max(0, min(full, self.sink // bs - blocks_before))
        if sinks:
            row[0, :, :, base : base + sinks * bs] = region_k[:, :, start : start + sinks * bs]
            row[1, :, :, base : base + sinks * bs] = region_v[:, :, start : start + sinks * bs]
            base += sinks * bs
        rest = total - start - full * bs
        keep_recent = min(self.recent, start + (full - sinks) * bs)
        keep = keep_recent + rest
        row[0, :, :, base : base + keep] = region_k[:, :, total - keep :]
        row[1, :, :, base : base + keep] = region_v[:, :, total - keep :]
        seq.num_sink, seq.num_recent, seq.num_filling = base, keep_recent, base + keep
        done = slice(start, start + full * bs)
        return RowAppend(region_k[:, :, done], region_v[:, :, done], full, old_partial)
