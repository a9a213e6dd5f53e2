"""Scoring a text with the engine: per-token log-probabilities, prefilled in chunks then teacher-forced one token at a
time (as generation decodes), for perplexity and fidelity against the exact cache (tools/eval.py)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from flashmemory.engine.kv_snapshot import engine_fingerprint, restore_prefill, save_prefill
from flashmemory.errors import ConfigError
from flashmemory.kvcache.interface import KVCache


class Scorable(Protocol):
    """What scoring needs of the engine (FlashMemoryEngine has it)."""

    config: Any
    cache: KVCache
    device: torch.device
    core: Any

    def check_prompt(self, prompt_ids: list[int], max_new_tokens: int = 0) -> None: ...

    def forward_tokens(self, seq_id: int, token_ids: list[int],
                       all_logits: bool = False) -> torch.Tensor: ...


@dataclass
class ScoreResult:
    """Output of FlashMemoryEngine.score_tokens."""

    token_logprobs: torch.Tensor  # [len - 1 - num_restored_tokens]: log p(token[t + 1] | tokens[: t + 1])
    decode_logprobs: torch.Tensor  # [teacher-forced positions, vocab]: full log-softmax at each decode step
    num_prefill_tokens: int
    decode_seconds: float
    num_decode_steps: int
    kv_stats: dict[str, int | float]  # the cache's counters just before the sequence was freed
    num_restored_tokens: int = 0  # prompt tokens whose KV came from a snapshot (no log-probs for them)
    snapshot_notes: dict[str, Any] = field(default_factory=dict)  # what the run that made the snapshot measured


def score_tokens(engine: Scorable, token_ids: list[int], num_teacher_forced: int = 0,
                 kv_snapshot: Path | None = None) -> ScoreResult:
    """Log-probabilities the model gives each next token of `token_ids` (for perplexity and fidelity).

    The first len - num_teacher_forced tokens are prefilled in chunks (their next-token log-probs come from
    the prefill); the last num_teacher_forced tokens are fed one at a time as in generation, so query-aware
    selection and quantized levels act exactly as when decoding. Returns per-position log-probs of the
    actual next token, plus the full log-softmax of the teacher-forced positions.

    kv_snapshot: a file (engine/kv_snapshot.py). If it exists, the prefill tokens before the last prefill chunk are
    restored from it instead of computed (checked against the model and the tokens); if not, this run's prefill
    KV is saved there (the exact cache only) before the decode steps.
    """
    engine.check_prompt(token_ids, max_new_tokens=0)
    n_prefill = len(token_ids) - num_teacher_forced
    if n_prefill < 1:
        raise ConfigError("num_teacher_forced must leave at least one token to prefill")
    seq_id = engine.core.next_seq_id()
    engine.cache.add_sequence(seq_id)
    target = torch.tensor(token_ids[1:], device=engine.device)
    prefill_lp: list[torch.Tensor] = []
    decode_dists: list[torch.Tensor] = []
    restored, notes = 0, {}
    try:
        chunk = engine.config.prefill_chunk_tokens
        fingerprint = engine_fingerprint(engine) if kv_snapshot is not None else {}
        if kv_snapshot is not None and kv_snapshot.exists():
            restored, notes = restore_prefill(engine.cache, seq_id, token_ids[:n_prefill], kv_snapshot, fingerprint,
                                              chunk)
        t_prefill = time.perf_counter()
        for start in range(restored, n_prefill, chunk):
            piece = token_ids[start : min(start + chunk, n_prefill)]
            logits = engine.forward_tokens(seq_id, piece, all_logits=True)
            lp = torch.log_softmax(logits, dim=-1)
            ends = torch.arange(start, start + len(piece), device=engine.device)
            valid = ends < len(token_ids) - 1
            prefill_lp.append(lp[valid].gather(1, target[ends[valid]][:, None])[:, 0])
        if kv_snapshot is not None and not kv_snapshot.exists():
            nll = -torch.cat(prefill_lp).mean().item()
            notes = {"prefill_ppl": math.exp(nll), "prefill_seconds": time.perf_counter() - t_prefill,
                     "prefill_chunk_tokens": chunk}
            save_prefill(engine.cache, seq_id, token_ids[:n_prefill], kv_snapshot, fingerprint, notes)
        t0 = time.perf_counter()
        for pos in range(n_prefill, len(token_ids)):
            lp = torch.log_softmax(engine.forward_tokens(seq_id, [token_ids[pos]])[-1], dim=-1)
            if pos < len(token_ids) - 1:
                decode_dists.append(lp)
        decode_seconds = time.perf_counter() - t0
        kv_stats = dict(engine.cache.stats())
    finally:
        engine.cache.free_sequence(seq_id)
    dists = torch.stack(decode_dists) if decode_dists else torch.empty(0)
    all_lp = torch.cat(prefill_lp) if prefill_lp else torch.empty(0)
    if decode_dists:
        forced = target[n_prefill:]  # decode step at position p predicts token p + 1
        all_lp = torch.cat([all_lp, dists.gather(1, forced[:, None])[:, 0]])
    return ScoreResult(all_lp, dists, n_prefill, decode_seconds, num_teacher_forced, kv_stats, restored, notes)
