"""`flashmemory trace`: record query-aware selection traces over a real text (teacher-forced decoding).

A window of `context_tokens` tokens of the text is prefilled, then the next `decode_steps` tokens of the same text
are fed one at a time, as in generation, with the cache's TraceRecorder on. Several windows (`num_windows`, taken
at evenly spaced offsets) give the predictor more than one context to learn from.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from flashmemory.errors import ConfigError
from flashmemory.kvcache.prefetch.access_trace import TraceRecorder

logger = logging.getLogger(__name__)

# The evaluation's hierarchy: a small warm level so most old blocks live on L2 (disk).
TRACE_KNOBS: dict[str, Any] = {"active_window": 2048, "warm_tokens": 2048}


def text_windows(token_ids: list[int], context_tokens: int, decode_steps: int, num_windows: int) -> list[list[int]]:
    """`num_windows` windows of context_tokens + decode_steps tokens, evenly spaced over the text."""
    span = context_tokens + decode_steps
    if len(token_ids) < span:
        raise ConfigError(f"the text has {len(token_ids)} tokens; a window needs {span} (context_tokens + "
                          "decode_steps): use a longer text or a shorter context")
    room = len(token_ids) - span
    starts = [room * i // max(num_windows - 1, 1) for i in range(num_windows)] if num_windows > 1 else [0]
    return [token_ids[s : s + span] for s in starts]


def record_trace(engine, text: str, context_tokens: int, decode_steps: int, num_windows: int = 1) -> TraceRecorder:
    """Teacher-forced decoding over windows of `text` with an engine built with record_traces=True."""
    trace = getattr(engine.cache, "trace", None)
    if trace is None:
        raise ConfigError("the engine does not record traces: build it with kv_cache='tiered', record_traces=True")
    ids = engine.tokenizer.encode(text)
    for i, window in enumerate(text_windows(ids, context_tokens, decode_steps, num_windows)):
        before = len(trace)
        engine.score_tokens(window, num_teacher_forced=decode_steps)
        logger.info("window %d: %d choices recorded", i, len(trace) - before)
    return trace


def read_text(path: str | Path) -> str:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise ConfigError(f"cannot read text {str(path)!r}: {e.strerror}") from e


def train_from_traces(train_paths: list[str], held_out_paths: list[str], out: str | Path, epochs: int = 3,
                      horizon_steps: int = 1, seed: int = 0, hidden: int = 16) -> dict[str, float]:
    """Train the heat predictor on `train_paths` (choices on L1 and L2: it ranks both, for device staging and for
    L2 prefetch), save it to `out`, and compare it with the recency/LRU baseline on the held-out traces (other
    texts), per level. Returns the figures."""
    import numpy as np

    from flashmemory.kvcache.prefetch.access_trace import trace_dataset
    from flashmemory.kvcache.prefetch.heat_predictor import compare_with_lru, train_heat_predictor

    def dataset(paths: list[str], levels: tuple[int, ...]):
        parts = [trace_dataset(TraceRecorder.load(p), horizon_steps, levels) for p in paths]
        offset, xs, ys, gs = 0, [], [], []
        for x, y, g in parts:
            xs.append(x)
            ys.append(y)
            gs.append(g + offset)
            offset += int(g.max()) + 1
        return np.concatenate(xs), np.concatenate(ys), np.concatenate(gs)

    if not train_paths or not held_out_paths:
        raise ConfigError("give at least one training trace and one held-out trace (recorded on another text)")
    x, y, _ = dataset(train_paths, (1, 2))
    predictor = train_heat_predictor(x, y, epochs=epochs, seed=seed, hidden=hidden)
    predictor.save(out)
    hx, hy, hg = dataset(held_out_paths, (2,))
    figures = compare_with_lru(predictor, hx, hy, hg)  # L2: what prefetch from disk ranks
    try:
        l1 = compare_with_lru(predictor, *dataset(held_out_paths, (1,)))
        figures.update({f"L1_{k}": v for k, v in l1.items() if "precision" in k or "recall" in k})
    except ConfigError:
        pass  # the held-out traces have no L1 choices
    figures.update({"num_parameters": predictor.num_parameters, "train_rows": len(x), "held_out_rows": len(hx),
                    "train_positive_fraction": float(y.mean())})
    return figures
