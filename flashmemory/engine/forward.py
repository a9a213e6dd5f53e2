"""One sequence's tokens straight through the model, outside the scheduler and the sampler: what
FlashMemoryEngine.forward_tokens runs for scoring, benchmarks and tests."""

from __future__ import annotations

import torch

from flashmemory.kvcache.interface import ForwardBatch, KVCache


def forward_chunks(model: torch.nn.Module, cache: KVCache, device: torch.device, seq_id: int,
                   token_ids: list[int], chunk_tokens: int,
                   all_logits: bool = False) -> torch.Tensor:
    """Extend `seq_id` by `token_ids` in forwards of at most `chunk_tokens`, each committed to the
    cache; returns the logits [1, vocab] of the last token, or [len(token_ids), vocab] with
    `all_logits`."""
    outputs = []
    for start in range(0, len(token_ids), chunk_tokens):
        piece = token_ids[start : start + chunk_tokens]
        num_cached = cache.num_tokens(seq_id)
        batch = ForwardBatch.build([(seq_id, num_cached, len(piece))], device)
        input_ids = torch.tensor(piece, dtype=torch.long, device=device)
        is_last = start + chunk_tokens >= len(token_ids)
        if all_logits or is_last:
            last = None if all_logits else torch.tensor([len(piece) - 1], device=device)
            outputs.append(model(input_ids, cache, batch, logits_indices=last))
        else:  # an inner chunk only stores its KV: no logits wanted
            model(input_ids, cache, batch, logits_indices=torch.empty(0, dtype=torch.long))
        cache.commit(batch)
    return torch.cat(outputs) if len(outputs) > 1 else outputs[0]
