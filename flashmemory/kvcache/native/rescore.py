"""The two-pass read's second pass through the native kernel (csrc/block_rescore.c): the
candidate blocks' FP16 keys scored in place in an in-memory pool's records, where the torch path
(read/selection.py rescore_scores) gathers a float copy of them and runs about ten ops per layer.
The torch path stays the reference and the fallback."""

from __future__ import annotations

import ctypes

import torch

from flashmemory.kvcache.native.loader import library
from flashmemory.kvcache.native.selection import as_cpu

MAX_HEAD_DIM = 256  # FM_RESCORE_MAX_DIM
MAX_GROUP = 32  # FM_RESCORE_MAX_GROUP
MAX_BLOCK_TOKENS = 64  # FM_RESCORE_MAX_TOKENS


class NativeRescore:
    """Scores candidate blocks by their FP16 keys' attention mass; None where it cannot."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    def scores(self, q: torch.Tensor, records: torch.Tensor, key_offset: int,
               key_dtype: torch.dtype, block_tokens: int,
               slots: torch.Tensor) -> torch.Tensor | None:
        """[num_kv_heads, c] float32: rescore_scores of the candidates, or None (use torch).

        q: [num_heads, head_dim] (one decode token); records: one layer's records
        [num_kv_heads, slots, record_bytes] uint8 on the CPU, each holding block_tokens fp16 key
        rows at key_offset; slots: [num_kv_heads, c] the candidates' slots. Only float16 keys.
        """
        heads, c = slots.shape
        num_heads, head_dim = q.shape
        if (key_dtype != torch.float16 or records.device.type != "cpu"
                or records.dtype != torch.uint8 or records.dim() != 3
                or records.stride(2) != 1 or records.stride(1) != records.shape[2]
                or records.shape[0] != heads or head_dim % 8 or head_dim > MAX_HEAD_DIM
                or num_heads % heads or num_heads // heads > MAX_GROUP
                or block_tokens > MAX_BLOCK_TOKENS or c == 0
                or key_offset + block_tokens * head_dim * 2 > records.shape[2]):
            return None
        qf, rows = as_cpu(q, torch.float32), as_cpu(slots, torch.int64)
        out = torch.empty((heads, c), dtype=torch.float32)
        rc = self.lib.fm_rescore_blocks(
            qf.data_ptr(), heads, num_heads // heads, head_dim, records.data_ptr(),
            records.stride(0), records.shape[2], key_offset, rows.data_ptr(), c, block_tokens,
            ctypes.c_float(head_dim**-0.5), out.data_ptr(), torch.get_num_threads())
        return out if rc == 0 else None


def native_rescore(device: torch.device) -> NativeRescore | None:
    """The kernel's second pass for a cache computing on `device`; None off the CPU or without
    it."""
    if device.type != "cpu":
        return None
    lib = library()
    return None if lib is None else NativeRescore(lib)
