"""score_tokens: teacher-forced log-probs agree with a plain forward over the same tokens (exact cache)."""

from __future__ import annotations

import torch

from flashmemory import FlashMemoryEngine


def test_teacher_forced_logprobs_match_one_forward(tiny_llama):
    engine = FlashMemoryEngine(model_path=str(tiny_llama), kv_cache="contiguous", prefill_chunk_tokens=16)
    ids = torch.randint(3, 300, (50,), generator=torch.Generator().manual_seed(0)).tolist()
    result = engine.score_tokens(ids, num_teacher_forced=10)
    logits = engine.prompt_logits(ids)
    expected = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert result.token_logprobs.shape == (49,)
    assert (result.token_logprobs - expected).abs().max() < 1e-4
    assert result.decode_logprobs.shape == (9, logits.shape[1])
    assert result.num_prefill_tokens == 40 and engine.cache.sequence_ids() == []
