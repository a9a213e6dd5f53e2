"""Sequence: one generation stream (one choice of one request) as the scheduler sees it (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from flashmemory.kvcache.manager.capacity import SequenceLoad


class SequenceStatus(Enum):
    WAITING = "waiting"  # no KV in the cache (new, or preempted by recompute)
    RUNNING = "running"  # in the cache with its L0 copies; scheduled every step
    PARKED = "parked"  # preempted by demotion: KV in L1/L2 and a filling-block row, nothing else in L0
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One generation stream (one choice of one request): its tokens and how many of them the KV cache holds."""

    seq_id: int
    prompt_ids: list[int]
    max_tokens: int  # generated tokens at most (already capped by the context length)
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    status: SequenceStatus = SequenceStatus.WAITING
    num_preemptions: int = 0
    num_cached_prefix_tokens: int = 0  # tokens reused from the prefix cache when it was last admitted
    num_faults: int = 0  # failures while serving it (a corrupt cold block, a full disk): recomputed once, then failed
    pinned_spans: tuple[tuple[int, int], ...] = ()  # [start, end) token ranges the cache keeps in L0
    # Admitted again without the prefix cache: reusing its prefix failed (a cached block could not be read, a
    # level was full while restoring it).
    skip_prefix_reuse: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens to run through the model before the next one can be sampled."""
        return self.num_tokens - self.num_computed_tokens

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:p] + self.output_ids[max(0, start - p) : end - p]

    def load(self, num_tokens: int | None = None, on_device: bool = True) -> SequenceLoad:
        """What it holds in the KV cache with `num_tokens` committed tokens (default: now), for capacity checks."""
        tokens = self.num_computed_tokens if num_tokens is None else num_tokens
        return SequenceLoad(tokens, self.pinned_spans, on_device)
