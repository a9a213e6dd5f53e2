"""The KV-cache interface: the only way the decoder's attention reaches keys and values."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

import torch

from flashmemory.errors import KVSnapshotError
from flashmemory.kvcache.kv_stats import KVStats
from flashmemory.kvcache.manager.capacity import KVCapacity
from flashmemory.kvcache.preload import PreloadResult


@dataclass(frozen=True)
class SequenceSlice:
    """One sequence's share of a flattened forward batch."""

    seq_id: int
    token_start: int  # index of the sequence's first new token in the batch's token dimension
    num_new_tokens: int
    num_cached_tokens: int  # tokens of this sequence already in the cache before this forward
    token_ids: tuple[int, ...] | None = None  # the new tokens themselves (to name full blocks for prefix reuse)
    # Each new token attends as a decode step at its position would (a speculative verification):
    # the reads a decode makes, not a prefill chunk's; see KVCache.max_decode_rows.
    as_decode: bool = False

    @property
    def token_end(self) -> int:
        return self.token_start + self.num_new_tokens

    @property
    def decoding(self) -> bool:
        """Every new token is read as a decode step reads (one token, or a verification)."""
        return self.num_new_tokens == 1 or self.as_decode


@dataclass(frozen=True)
class ForwardBatch:
    """Which sequences a forward pass extends, and by how many tokens each (tokens are flattened, no padding)."""

    slices: tuple[SequenceSlice, ...]
    positions: torch.Tensor  # [num_tokens] absolute position of every new token
    max_position: int  # largest entry of `positions`, kept as a Python int to avoid a device sync

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    def only(self, index: int) -> "ForwardBatch":
        """The batch of slice `index` alone (positions of its own tokens)."""
        s = self.slices[index]
        single = SequenceSlice(s.seq_id, 0, s.num_new_tokens, s.num_cached_tokens, s.token_ids,
                               s.as_decode)
        positions = self.positions[s.token_start : s.token_end]
        return ForwardBatch((single,), positions, s.num_cached_tokens + s.num_new_tokens - 1)

    @classmethod
    def build(cls, new_tokens: list[tuple], device: torch.device,
              as_decode: Collection[int] = ()) -> "ForwardBatch":
        """From (seq_id, num_cached_tokens, num_new_tokens[, token_ids]) tuples, in batch order;
        the sequences in `as_decode` have their new tokens read as decode steps."""
        slices, ranges, start, max_position = [], [], 0, 0
        for seq_id, num_cached, num_new, *tokens in new_tokens:
            ids = tuple(tokens[0]) if tokens else None
            slices.append(SequenceSlice(seq_id, start, num_new, num_cached, ids,
                                        seq_id in as_decode))
            ranges.append(torch.arange(num_cached, num_cached + num_new))
            start += num_new
            max_position = max(max_position, num_cached + num_new - 1)
        positions = torch.cat(ranges).to(device)
        return cls(tuple(slices), positions, max_position)


def kept_tokens(s: SequenceSlice, kept: Mapping[int, int] | None) -> int:
    """How many of the slice's new tokens a commit keeps (KVCache.commit's `kept`): all by
    default."""
    n = s.num_new_tokens if kept is None else kept.get(s.seq_id, s.num_new_tokens)
    if not 0 <= n <= s.num_new_tokens:
        raise ValueError(f"sequence {s.seq_id}: cannot keep {n} of {s.num_new_tokens} new tokens")
    return n


class KVCache(ABC):
    """Owns the keys and values of every live sequence and computes attention over them.

    The decoder hands each layer's post-RoPE keys and values of the new tokens to `attend`, which stores
    them and returns the attention output. Where the old keys live (device, host, disk), at what precision,
    and which of them are read, is the implementation's business: model code never sees it.
    """

    @abstractmethod
    def add_sequence(self, seq_id: int) -> None:
        """Start an empty sequence."""

    @abstractmethod
    def free_sequence(self, seq_id: int, keep_cached: bool = True) -> None:
        """Release everything the sequence holds, on every level (blocks a prefix cache keeps stay cached unless
        `keep_cached` is False)."""

    @abstractmethod
    def num_tokens(self, seq_id: int) -> int:
        """Tokens of the sequence stored so far (committed forwards only)."""

    @abstractmethod
    def kv_capacity(self) -> KVCapacity:
        """What the cache can hold (blocks per level and the placement policy), for the scheduler's checks."""

    def reuse_prefix(self, seq_id: int, token_ids: list[int], count: bool = True) -> int:
        """Attach cached KV of the longest known prefix of `token_ids` to a new sequence; the tokens reused (a cache
        without a prefix cache reuses none)."""
        return 0

    def import_shared_prefix(self, token_ids: list[int]) -> int:
        """Install the blocks of `token_ids` a shared level holds past the local prefix, as cached
        blocks (kvcache/remote/importer.py); returns how many. A cache without one installs none."""
        return 0

    def preload_prefix(self, token_ids: list[int],
                       should_stop: Callable[[], str | None] = lambda: None) -> PreloadResult:
        """Bring the cached blocks of the longest cached prefix of `token_ids` up to the levels
        a request reusing them reads (kvcache/preload.py); a cache without a prefix cache has
        nothing to preload."""
        return PreloadResult(prompt_tokens=len(token_ids))

    def max_decode_rows(self, seq_id: int) -> int:
        """How many new tokens one forward of the sequence may read as decode steps (an `as_decode`
        slice) with every one of them reading what a decode step at its position would read; a
        cache whose reads do not change with the sequence's length takes any number."""
        return 1 << 30

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Forget the sequence's committed tokens from `num_tokens` on, as if they were never
        computed (a draft model's rejected proposals). A cache that cannot says so."""
        raise NotImplementedError(f"{type(self).__name__} cannot forget committed tokens")

    def pin_span(self, seq_id: int, start: int, end: int) -> None:
        """Keep tokens [start, end) of the sequence in device memory whatever the window (a cache that keeps
        everything on the device has nothing to do)."""

    def demote_sequence(self, seq_id: int) -> int:
        """Drop the sequence's device copies (preemption); a cache without levels never preempts."""
        raise RuntimeError(f"{type(self).__name__} has no levels to demote to")  # the scheduler never asks it

    def promote_sequence(self, seq_id: int) -> int:
        """Undo demote_sequence."""
        raise RuntimeError(f"{type(self).__name__} has no levels to promote from")

    def export_kv(self, seq_id: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [num_layers, num_kv_heads, num_tokens, head_dim] of the sequence's first tokens, exactly
        as stored (for a KV snapshot); only a cache that holds every token unapproximated can."""
        raise KVSnapshotError(f"{type(self).__name__} cannot export exact KV: make snapshots with the exact "
                              "cache (kv_cache='contiguous', kv_precision='fp16')")

    def append_kv(self, seq_id: int, keys: torch.Tensor, values: torch.Tensor, token_ids: list[int]) -> None:
        """Store post-RoPE keys and values [num_layers, num_kv_heads, n, head_dim] of the sequence's next n tokens
        (`token_ids`) as a prefill forward over them would, without computing attention (restoring a snapshot)."""
        raise KVSnapshotError(f"{type(self).__name__} cannot restore a KV snapshot")

    def attend(
        self, layer_idx: int, batch: ForwardBatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Store k, v [T, num_kv_heads, head_dim] of the new tokens; return causal attention [T, num_heads, head_dim]
        of q [T, num_heads, head_dim] over each sequence's earlier and new tokens."""
        if len(batch.slices) == 1:
            return self.attend_sequence(layer_idx, batch.slices[0], q, k, v)
        out = torch.empty_like(q)
        for s in batch.slices:
            sl = slice(s.token_start, s.token_end)
            out[sl] = self.attend_sequence(layer_idx, s, q[sl], k[sl], v[sl])
        return out

    @abstractmethod
    def attend_sequence(
        self, layer_idx: int, s: SequenceSlice, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """`attend` for one sequence's slice of the batch: q [n, num_heads, head_dim], k/v [n, num_kv_heads, head_dim]."""

    @abstractmethod
    def commit(self, batch: ForwardBatch, kept: Mapping[int, int] | None = None) -> None:
        """Called once after all layers of a forward: the new tokens become part of their sequences.

        kept: per sequence id, how many of its new tokens stay (the first ones; a speculative
        verification keeps the accepted draft tokens): the rest is forgotten as `rollback` forgets
        a forward, and the sequence goes on from the last token kept. Absent: all stay."""

    def rollback(self, batch: ForwardBatch) -> None:
        """The forward failed before commit: forget what it stored so far (its sequences stay as they were)."""

    def has_sequence(self, seq_id: int) -> bool:
        return seq_id in self.sequence_ids()

    @abstractmethod
    def sequence_ids(self) -> list[int]:
        """Ids of the live sequences."""

    def clear(self) -> None:
        """Free every sequence."""
        for seq_id in list(self.sequence_ids()):
            self.free_sequence(seq_id)

    @abstractmethod
    def kv_stats(self) -> KVStats:
        """Counters for metrics and tools, typed (bytes, tokens, sequences, every level)."""

    def stats(self) -> dict[str, int | float]:
        """Counters for users (engine.stats(), JSON files): kv_stats() in its flat, public form."""
        return self.kv_stats().as_dict()

    # ---- sessions and lifetime: every cache answers; one without sessions with a typed error ----

    @abstractmethod
    def save_session(self, name: str, token_ids: list[int]) -> int:
        """Keep the cached KV of `token_ids` under `name`, never evicted until deleted; returns
        the tokens kept (whole blocks). A cache that keeps no sessions raises
        SessionsUnavailableError naming the setting to change."""

    @abstractmethod
    def load_session(self, name: str) -> list[int] | None:
        """The tokens saved under `name`, or None if no session has that name."""

    @abstractmethod
    def delete_session(self, name: str) -> None:
        """Release the session `name` (its blocks become evictable); no-op if there is none."""

    @abstractmethod
    def session_names(self) -> list[str]:
        """Names of the saved sessions (none in a cache that keeps no sessions)."""

    @abstractmethod
    def flush_cache(self) -> int:
        """Write the cached blocks down to the persistent level and publish its index
        (persist_cache); returns the blocks indexed, 0 where nothing persists."""

    @abstractmethod
    def close(self) -> None:
        """Release what the cache holds besides memory (files, threads), saving what persists
        first; the cache is not used afterwards."""
