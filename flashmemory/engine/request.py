"""What goes into the engine core (SequenceRequest) and what comes out of it each step (SequenceOutput)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from flashmemory.engine.sampling import SamplingParams
from flashmemory.kvcache.kv_stats import KVStats


@dataclass
class SequenceRequest:
    """One choice to generate, as a frontend submits it (already tokenized and validated)."""

    index: int  # the choice index within its request
    prompt_ids: list[int]
    params: SamplingParams
    arrival_s: float  # time.perf_counter() when the request arrived
    pinned_spans: tuple[tuple[int, int], ...] = ()  # [start, end) prompt token ranges kept in L0
    capture_kv_stats: bool = False  # snapshot the cache's stats as the sequence ends (before its blocks go)
    progress: Callable[[int, int], None] | None = None  # told (prompt tokens computed, prompt tokens) during prefill


@dataclass
class SequenceOutput:
    """What one step produced for one sequence."""

    index: int  # the choice index within its request
    text: str  # newly released text (may be empty)
    num_new_tokens: int
    finish_reason: str | None = None  # "stop" | "length" | "content_filter" when it is done
    stop_reason: str | None = None  # content_filter: what the guardrail flagged (label, score)
    error: str | None = None  # the sequence failed; the message is safe to show a client
    exception: BaseException | None = None  # the typed error behind `error`, for callers that raise it
    token_id: int | None = None  # the sampled token, None for an end-of-sequence token that ends it
    first_forward_s: float | None = None  # on the first output: perf_counter() when its first forward began
    produced_s: float = 0.0  # perf_counter() when the token was sampled
    kv_stats: dict[str, int | float] = field(default_factory=dict)  # on the last output, when asked for
    kv_snapshot: KVStats | None = None  # the same snapshot, typed (kvcache/kv_stats.py)


Sink = Callable[[SequenceOutput], None]
