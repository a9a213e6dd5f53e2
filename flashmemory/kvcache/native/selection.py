"""Quest selection through the native kernel (csrc/quest_select.c): one call per layer and level scores every
candidate block, lifts the hinted ones and keeps the best `budget` per KV head, where the torch path
(read/selection.py, read/hints.py) runs about twenty ops. The torch path stays the reference and the fallback."""

from __future__ import annotations

import ctypes

import torch

from flashmemory.kvcache.native.loader import MAX_DIGEST_BOXES, MAX_GROUP, MAX_HEAD_DIM, library


class NativeSelection:
    """Runs Quest's choice in the compiled kernel for float32 CPU digests; says None where it cannot."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    def select(self, q: torch.Tensor, digest: torch.Tensor, budget: int, indices: torch.Tensor | None = None,
               hints: torch.Tensor | None = None, scores: torch.Tensor | None = None) -> torch.Tensor | None:
        """Indices [num_kv_heads, budget] (ascending) of the chosen blocks, or None (use the torch path).

        q: [num_heads, head_dim] (one decode token); digest: [num_kv_heads, n, boxes * 2 * head_dim] float32 or
        float16 on the CPU (read/selection.py's key_digest);
        indices: [n] int64 ascending logical indices of the blocks and hints [num_kv_heads, k] logical indices
        always chosen (both or neither); scores: [num_kv_heads, n] float32, filled with the raw scores when given.
        """
        heads, n, width = digest.shape
        num_heads, head_dim = q.shape
        if (digest.dtype not in (torch.float32, torch.float16) or digest.device.type != "cpu" or q.device.type != "cpu"
                or digest.stride(2) != 1 or width % (2 * head_dim) or head_dim > MAX_HEAD_DIM or head_dim % 8
                or num_heads % heads or num_heads // heads > MAX_GROUP or not 1 <= budget <= n
                or width // (2 * head_dim) > MAX_DIGEST_BOXES):
            return None
        q = as_cpu(q, torch.float32)
        chosen = torch.empty((heads, budget), dtype=torch.int64)
        hint_ptr, num_hints, index_ptr = None, 0, None
        if hints is not None:
            assert indices is not None
            hints, indices = as_cpu(hints, torch.int64), as_cpu(indices, torch.int64)
            hint_ptr, num_hints, index_ptr = hints.data_ptr(), hints.shape[1], indices.data_ptr()
        if scores is not None:
            assert scores.shape == (heads, n) and scores.dtype == torch.float32 and scores.is_contiguous()
        rc = self.lib.fm_quest_select(q.data_ptr(), heads, num_heads // heads, head_dim, digest.data_ptr(),
                                      int(digest.dtype == torch.float16), width // (2 * head_dim), digest.stride(0),
                                      digest.stride(1), n, index_ptr, hint_ptr, num_hints, budget, chosen.data_ptr(),
                                      None if scores is None else scores.data_ptr())
        return chosen if rc == 0 else None


def as_cpu(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t as a contiguous CPU tensor of `dtype`; itself when it already is (no op dispatched: this runs per layer)."""
    if t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous():
        return t
    return t.to(device="cpu", dtype=dtype).contiguous()


def native_selection(device: torch.device) -> NativeSelection | None:
    """The kernel's selection for a cache computing on `device`; None off the CPU or without the library."""
    lib = library() if device.type == "cpu" else None
    return NativeSelection(lib) if lib is not None else None
