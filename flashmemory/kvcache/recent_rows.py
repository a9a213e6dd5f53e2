"""RecentRows: every live sequence's newest tokens, unquantized (FP16) in device memory.

A row holds the still-filling block and, when `recent_tokens` > 0, the last full blocks as well. Those blocks
are written to the levels like any other (an INT4 L0 copy, the FP16 L1 master, names for the prefix cache), but
a forward attends them here, in FP16, instead of through their INT4 L0 copy: the newest tokens are the ones a
step attends most, so they are the ones rounding hurts most (KIVI keeps such a full-precision residual too).
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


class RecentRows:
    """Owns the arena of rows [max_num_seqs, 2, num_layers, heads, recent + block_size, head_dim] and which are free."""

    def __init__(self, max_num_seqs: int, num_layers: int, num_kv_heads: int, block_size: int, head_dim: int,
                 recent_tokens: int, device: torch.device) -> None:
        """recent_tokens: full-block tokens kept (a multiple of block_size; see `recent_capacity`)."""
        self.block_size = block_size
        self.recent = recent_tokens
        self.arena = torch.zeros((max_num_seqs, 2, num_layers, num_kv_heads, self.recent + block_size, head_dim),
                                 dtype=KV_DTYPE, device=device)
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
        """The sequence's row for one layer: [2, heads, num_filling, head_dim], oldest token first."""
        return self.arena[seq.filling_row, :, layer, :, : seq.num_filling]

    @property
    def row_bytes(self) -> int:
        return self.arena[0].numel() * self.arena.element_size()

    @property
    def nbytes(self) -> int:
        return self.arena.numel() * self.arena.element_size()

    def load(self, seq: SequenceKV, kv: torch.Tensor) -> None:
        """Fill an empty sequence's row with the full blocks it starts with (a reused prefix's newest blocks):
        kv [2, num_layers, heads, tokens, head_dim], tokens a multiple of block_size, at most the row's recent."""
        tokens = kv.shape[3]
        if seq.num_filling or tokens % self.block_size or tokens > self.recent:
            raise ValueError(f"cannot load {tokens} tokens into a row holding {seq.num_filling} (recent {self.recent})")
        self.arena[seq.filling_row, :, :, :, :tokens] = kv
        seq.num_filling = seq.num_recent = tokens

    # ---- commit -----------------------------------------------------------------------------------------------

    def append(self, seq: SequenceKV, new_k: torch.Tensor, new_v: torch.Tensor) -> RowAppend:
        """Add a forward's keys and values [num_layers, heads, n, head_dim] to the sequence's row; returns the blocks
        they completed. The row keeps the newest `recent` full-block tokens and the rest of a block."""
        bs, row = self.block_size, self.arena[seq.filling_row]
        n = new_k.shape[2]
        old_partial = seq.num_filling - seq.num_recent
        full = (old_partial + n) // bs
        if full == 0:  # the common decode step: the token goes into place
            row[0, :, :, seq.num_filling : seq.num_filling + n] = new_k
            row[1, :, :, seq.num_filling : seq.num_filling + n] = new_v
            seq.num_filling += n
            empty = new_k[:, :, :0]
            return RowAppend(empty, empty, 0, old_partial)
        all_k = torch.cat((row[0, :, :, : seq.num_filling], new_k), dim=2)
        all_v = torch.cat((row[1, :, :, : seq.num_filling], new_v), dim=2)
        start = seq.num_recent
        total = all_k.shape[2]
        rest = total - start - full * bs
        keep_recent = min(self.recent, start + full * bs)
        keep = keep_recent + rest
        row[0, :, :, :keep] = all_k[:, :, total - keep :]
        row[1, :, :, :keep] = all_v[:, :, total - keep :]
        seq.num_filling, seq.num_recent = keep, keep_recent
        return RowAppend(all_k[:, :, start : start + full * bs], all_v[:, :, start : start + full * bs], full,
                         old_partial)
