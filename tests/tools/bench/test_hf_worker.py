"""transformers' caches in the worker: scoring rows line up with ours; a known HQQ failure gets its reason."""

from __future__ import annotations

import pytest
import torch

from flashmemory.tools.bench.hf_worker import explain_failure, load_model, score

HQQ4 = {"cache": "quantized", "backend": "hqq", "nbits": 4, "axis": 1}


def test_dynamic_cache_rows_match_our_exact_scoring(tiny_llama):
    from flashmemory import FlashMemoryEngine

    ids = [(i * 37 + 11) % 300 for i in range(80)]
    model, _ = load_model(str(tiny_llama), "float32")
    theirs = score(model, {"cache": "dynamic"}, ids, teacher_forced=12)
    engine = FlashMemoryEngine(model_path=str(tiny_llama), kv_cache="contiguous")
    ours = engine.score_tokens(ids, num_teacher_forced=12).decode_logprobs
    assert theirs.shape == ours.shape == (11, model.config.vocab_size)
    assert torch.allclose(theirs, ours, atol=1e-4)


def test_hqq_packing_failure_is_explained(tiny_llama):
    pytest.importorskip("hqq")
    model, _ = load_model(str(tiny_llama), "float32")
    ids = list(range(5, 5 + 106))  # 98 prefill tokens: 2 heads x 98 x 16 / 64 = 49 groups, odd
    with pytest.raises(RuntimeError) as info:
        score(model, HQQ4, ids, teacher_forced=8)
    explained = str(explain_failure(info.value, HQQ4, model, 98))
    assert "HQQ packs 2 4-bit codes per byte" in explained and "= 49 for 98 tokens" in explained
    other = RuntimeError("boom")
    assert explain_failure(other, {"cache": "dynamic"}, model, 98) is other
