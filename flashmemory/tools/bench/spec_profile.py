"""Where a speculative step's time goes: the target's one-token decode forward, its verification
forward of the last token and K drafts, and the draft model's one-token forward, each timed at
the same context (a prompt prefilled once; every timed forward rolled back), interleaved."""

from __future__ import annotations

import statistics
import time

import torch

from flashmemory.kvcache.interface import ForwardBatch


def _timed_forward(model, cache, seq_id: int, start: int, tokens: list[int],
                   as_decode: bool) -> float:
    """Seconds of one forward of `tokens` after `start` committed ones, then forgotten."""
    batch = ForwardBatch.build([(seq_id, start, len(tokens), tokens)], torch.device("cpu"),
                               as_decode={seq_id} if as_decode else ())
    ids = torch.tensor(tokens, dtype=torch.long)
    started = time.perf_counter()
    model(ids, cache, batch, logits_indices=torch.arange(len(tokens)))
    seconds = time.perf_counter() - started
    cache.rollback(batch)
    return seconds


def profile_step(engine, prompt_ids: list[int], k: int, reps: int = 5) -> dict[str, float]:
    """Median milliseconds of each part at `prompt_ids`' length (the engine has a draft model)."""
    proposer = engine.speculator.proposer
    block = getattr(getattr(engine.cache, "cfg", None), "block_size", 1)
    if len(prompt_ids) > block:  # end at a block's end, so the verification may carry every draft
        prompt_ids = prompt_ids[: len(prompt_ids) - len(prompt_ids) % block]
    parts = {"target": (engine.model, engine.cache), "draft": (proposer.model, proposer.cache)}
    seq_id = engine.core.next_seq_id()
    for model, cache in parts.values():
        cache.add_sequence(seq_id)
        for i in range(0, len(prompt_ids), 512):
            piece = prompt_ids[i : i + 512]
            batch = ForwardBatch.build([(seq_id, i, len(piece))], torch.device("cpu"))
            model(torch.tensor(piece), cache, batch,
                  logits_indices=torch.empty(0, dtype=torch.long))
            cache.commit(batch)
    n = len(prompt_ids)
    rows = min(k + 1, engine.cache.max_decode_rows(seq_id) - 1)
    times: dict[str, list[float]] = {"target_decode_ms": [], f"target_verify_{rows}_rows_ms": [],
                                     "draft_decode_ms": []}
    probe = prompt_ids[-rows:]
    for _ in range(reps):
        target, draft = parts["target"], parts["draft"]
        times["target_decode_ms"].append(_timed_forward(*target, seq_id, n, probe[:1], True))
        times[f"target_verify_{rows}_rows_ms"].append(
            _timed_forward(*target, seq_id, n, probe, True))
        times["draft_decode_ms"].append(_timed_forward(*draft, seq_id, n, probe[:1], True))
    for _, cache in parts.values():
        cache.free_sequence(seq_id, keep_cached=False)
    return {name: 1000 * statistics.median(ts) for name, ts in times.items()}
