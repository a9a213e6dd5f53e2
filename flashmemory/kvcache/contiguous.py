"""ContiguousKVCache: the exact baseline — every token's K/V in one growing tensor per sequence, in model dtype."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from flashmemory.errors import KVSnapshotError, SessionsUnavailableError
from flashmemory.kvcache.attention.dense import causal_attention
from flashmemory.kvcache.interface import ForwardBatch, KVCache, kept_tokens
from flashmemory.kvcache.kv_stats import ContiguousStats, KVStats
from flashmemory.kvcache.manager.capacity import KVCapacity

NO_SESSIONS = ("named sessions need the tiered KV cache with its prefix cache: set "
               "kv_cache='tiered' (the default) and prefix_caching=True; kv_cache='contiguous' "
               "keeps no sessions")
GROWTH_TOKENS = 256  # capacity is rounded up to this, then doubled, so a long generation reallocates O(log n) times


class ContiguousKVCache(KVCache):
    """Owns one [num_layers, 2, num_kv_heads, capacity, head_dim] tensor per sequence; attention reads all of it."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        max_seq_len: int,
        sliding_window_tokens: int | None = None,
        max_num_seqs: int = 16,
    ) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.max_seq_len = max_seq_len
        self.sliding_window_tokens = sliding_window_tokens
        self.max_num_seqs = max_num_seqs  # the only bound the scheduler checks: the tensors grow on demand
        self._kv: dict[int, torch.Tensor] = {}
        self._lengths: dict[int, int] = {}

    def add_sequence(self, seq_id: int) -> None:
        if seq_id in self._kv:
            raise ValueError(f"sequence {seq_id} already exists")
        self._kv[seq_id] = self._allocate(GROWTH_TOKENS)
        self._lengths[seq_id] = 0

    def free_sequence(self, seq_id: int, keep_cached: bool = True) -> None:
        self._kv.pop(seq_id, None)
        self._lengths.pop(seq_id, None)

    def sequence_ids(self) -> list[int]:
        return list(self._kv)

    def num_tokens(self, seq_id: int) -> int:
        return self._lengths[seq_id]

    def kv_capacity(self) -> KVCapacity:
        """No levels: every sequence's KV grows in place, only the number of sequences is bounded."""
        return KVCapacity(None, {}, self.max_num_seqs)

    def _allocate(self, capacity: int) -> torch.Tensor:
        shape = (self.num_layers, 2, self.num_kv_heads, capacity, self.head_dim)
        return torch.empty(shape, dtype=self.dtype, device=self.device)

    def _reserve(self, seq_id: int, needed: int) -> torch.Tensor:
        kv = self._kv[seq_id]
        capacity = kv.shape[3]
        if needed <= capacity:
            return kv
        new_capacity = min(max(needed, 2 * capacity), max(self.max_seq_len, needed))
        new_capacity = -(-new_capacity // GROWTH_TOKENS) * GROWTH_TOKENS
        grown = self._allocate(new_capacity)
        length = self._lengths[seq_id]
        grown[:, :, :, :length] = kv[:, :, :, :length]
        self._kv[seq_id] = grown
        return grown

    def attend_sequence(self, layer_idx, s, q, k, v) -> torch.Tensor:
        # q: [n, num_heads, head_dim]; k, v: [n, num_kv_heads, head_dim]
        start, end = s.num_cached_tokens, s.num_cached_tokens + s.num_new_tokens
        kv = self._reserve(s.seq_id, end)[layer_idx]  # [2, num_kv_heads, capacity, head_dim]
        kv[0, :, start:end] = k.transpose(0, 1)
        kv[1, :, start:end] = v.transpose(0, 1)
        keys, values = kv[0, :, :end], kv[1, :, :end]
        if keys.dtype != q.dtype:  # reduced-precision storage (the FP16 baseline): compute in the model dtype
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        if s.as_decode and s.num_new_tokens > 1:  # each token as its own decode step computes it
            window = self.sliding_window_tokens
            return torch.cat([causal_attention(q[i : i + 1], keys[:, : start + i + 1],
                                               values[:, : start + i + 1], start + i, window)
                              for i in range(s.num_new_tokens)])
        return causal_attention(q, keys, values, start, self.sliding_window_tokens)

    def export_kv(self, seq_id: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        if num_tokens > self._lengths[seq_id]:
            raise ValueError(f"sequence {seq_id} holds {self._lengths[seq_id]} tokens, not {num_tokens}")
        kv = self._kv[seq_id][:, :, :, :num_tokens]  # [num_layers, 2, num_kv_heads, num_tokens, head_dim]
        return kv[:, 0].clone(), kv[:, 1].clone()

    def append_kv(self, seq_id: int, keys: torch.Tensor, values: torch.Tensor, token_ids: list[int]) -> None:
        if keys.dtype != self.dtype:  # an FP16 snapshot in a float32 cache would not be what a prefill stores
            raise KVSnapshotError(f"the snapshot holds {keys.dtype} KV, this cache stores {self.dtype}: restore it "
                                  "into a cache of the same precision (kv_precision='fp16')")
        start = self._lengths[seq_id]
        end = start + keys.shape[2]
        kv = self._reserve(seq_id, end)
        kv[:, 0, :, start:end] = keys.to(self.device)
        kv[:, 1, :, start:end] = values.to(self.device)
        self._lengths[seq_id] = end

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self._lengths[seq_id]:
            raise ValueError(f"sequence {seq_id} holds {self._lengths[seq_id]} tokens; "
                             f"cannot keep {num_tokens}")
        self._lengths[seq_id] = num_tokens

    def commit(self, batch: ForwardBatch, kept: Mapping[int, int] | None = None) -> None:
        for s in batch.slices:
            self._lengths[s.seq_id] = s.num_cached_tokens + kept_tokens(s, kept)

    def kv_stats(self) -> KVStats:
        element = torch.empty((), dtype=self.dtype).element_size()
        per_token = 2 * self.num_layers * self.num_kv_heads * self.head_dim * element
        tokens = sum(self._lengths.values())
        allocated = sum(kv.numel() * element for kv in self._kv.values())
        contiguous = ContiguousStats(tokens * per_token, allocated)
        return KVStats(len(self._kv), tokens, contiguous=contiguous)

    # ---- sessions and lifetime: the exact baseline keeps no KV beyond its live sequences ----

    def save_session(self, name: str, token_ids: list[int]) -> int:
        raise SessionsUnavailableError(NO_SESSIONS)

    def load_session(self, name: str) -> list[int] | None:
        raise SessionsUnavailableError(NO_SESSIONS)

    def delete_session(self, name: str) -> None:
        raise SessionsUnavailableError(NO_SESSIONS)

    def session_names(self) -> list[str]:
        return []

    def flush_cache(self) -> int:
        return 0  # nothing persists

    def close(self) -> None:
        pass  # no files or threads; the tensors go with the cache object
