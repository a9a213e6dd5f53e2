"""Per-request options of the Python API: sampling parameters and pinned spans, validated; batch detection."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flashmemory.engine.sampling import SamplingParams
from flashmemory.errors import ConfigError


@dataclass
class RequestOptions:
    """One API call's per-request options, validated."""

    params: SamplingParams
    pinned: list[tuple[int, int]]  # [start, end) prompt token ranges kept in L0
    progress: Callable[[int, int], None] | None = None  # told (prompt tokens computed, prompt tokens) in prefill


def request_options(options: dict[str, Any]) -> RequestOptions:
    """Split per-request options into sampling parameters, pinned token spans and a progress callback."""
    options = dict(options)
    progress = options.pop("progress", None)
    if progress is not None and not callable(progress):
        raise ConfigError(f"progress={progress!r} must be a callable taking (tokens done, tokens in all)")
    spans = options.pop("pinned_spans", None) or []
    pinned = []
    for span in spans:
        if (not isinstance(span, (tuple, list)) or len(span) != 2 or not all(isinstance(x, int) for x in span)
                or not 0 <= span[0] < span[1]):
            raise ConfigError(f"pinned_spans entry {span!r} must be a (start, end) pair of token indices, start < end")
        pinned.append((int(span[0]), int(span[1])))
    return RequestOptions(sampling_params(options), pinned, progress)


def sampling_params(sampling: dict[str, Any]) -> SamplingParams:
    valid = SamplingParams.__dataclass_fields__
    unknown = sorted(set(sampling) - set(valid))
    if unknown:
        raise ConfigError(f"unknown sampling setting(s) {', '.join(unknown)}; valid: {', '.join(valid)}")
    return SamplingParams(**sampling)


def is_batch(prompt: object) -> bool:
    """A list of prompts (texts or token-id lists), as opposed to one prompt given as token ids."""
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and all(isinstance(p, (str, list, tuple))
                                                                          for p in prompt)
