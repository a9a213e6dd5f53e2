"""Our decoder against transformers' own model of the same tiny random checkpoints (float32, <= 1e-4)."""

from __future__ import annotations

import pytest
import torch

from flashmemory import FlashMemoryEngine
from tests.helpers import write_tiny_model

TOL = 1e-4
ROPE_CASES = {
    "default": {},
    "linear": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    "dynamic": {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    "llama3": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    "yarn": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
}


def _hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM",
                                  "Qwen3ForCausalLM", "Phi3ForCausalLM"])
def test_prefill_logits_match_transformers(tmp_path, arch):
    hf = write_tiny_model(tmp_path, arch, tie_word_embeddings=(arch == "Qwen2ForCausalLM"))
    engine = FlashMemoryEngine(model_path=str(tmp_path), dtype="float32", kv_cache="contiguous")
    ids = torch.randint(3, engine.model_config.vocab_size, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = engine.prompt_logits(ids)
    assert (ours - _hf_logits(hf, ids)).abs().max().item() <= TOL


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rope_scaling_matches_transformers(tmp_path, case):
    # 120 tokens with max_position_embeddings=96 so dynamic NTK actually rescales.
    hf = write_tiny_model(tmp_path, "LlamaForCausalLM", max_position_embeddings=96 if case == "dynamic" else 256,
                          **ROPE_CASES[case])
    engine = FlashMemoryEngine(model_path=str(tmp_path), dtype="float32", kv_cache="contiguous")
    ids = torch.randint(3, engine.model_config.vocab_size, (120,), generator=torch.Generator().manual_seed(2)).tolist()
    ours = engine.prompt_logits(ids)
    assert (ours - _hf_logits(hf, ids)).abs().max().item() <= TOL


def test_incremental_decode_matches_full_forward(tmp_path):
    """Prefill then one token at a time through the cache gives the logits of one full forward."""
    hf = write_tiny_model(tmp_path, "LlamaForCausalLM")
    engine = FlashMemoryEngine(model_path=str(tmp_path), dtype="float32", kv_cache="contiguous")
    ids = torch.randint(3, engine.model_config.vocab_size, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    full = _hf_logits(hf, ids)
    seq = 10_000
    engine.cache.add_sequence(seq)
    try:
        steps = [engine.forward_tokens(seq, ids[:25], all_logits=True)]
        for t in ids[25:]:
            steps.append(engine.forward_tokens(seq, [t]))
    finally:
        engine.cache.free_sequence(seq)
    ours = torch.cat(steps)
    assert (ours - full).abs().max().item() <= TOL


def test_chunked_prefill_and_two_sequences_in_one_batch(tmp_path):
    """A batch mixing a chunk of one sequence (with cached history) and another fresh sequence is exact."""
    from flashmemory.kvcache.interface import ForwardBatch

    hf = write_tiny_model(tmp_path, "MistralForCausalLM")
    engine = FlashMemoryEngine(model_path=str(tmp_path), dtype="float32", kv_cache="contiguous")
    gen = torch.Generator().manual_seed(4)
    a = torch.randint(3, engine.model_config.vocab_size, (50,), generator=gen).tolist()
    b = torch.randint(3, engine.model_config.vocab_size, (30,), generator=gen).tolist()
    cache = engine.cache
    cache.add_sequence(1)
    cache.add_sequence(2)
    try:
        first = engine.forward_tokens(1, a[:20], all_logits=True)
        batch = ForwardBatch.build([(1, 20, 30), (2, 0, 30)], engine.device)
        logits = engine.model(torch.tensor(a[20:] + b), cache, batch)
        cache.commit(batch)
    finally:
        cache.clear()
    assert (torch.cat([first, logits[:30]]) - _hf_logits(hf, a)).abs().max().item() <= TOL
    assert (logits[30:] - _hf_logits(hf, b)).abs().max().item() <= TOL


def test_sliding_window_matches_transformers(tmp_path):
    hf = write_tiny_model(tmp_path, "MistralForCausalLM", sliding_window=16)
    hf.config._attn_implementation = "eager"  # transformers applies the window through its mask
    engine = FlashMemoryEngine(model_path=str(tmp_path), dtype="float32", kv_cache="contiguous")
    ids = torch.randint(3, engine.model_config.vocab_size, (48,), generator=torch.Generator().manual_seed(5)).tolist()
    assert engine.model_config.sliding_window_tokens == 16
    assert (engine.prompt_logits(ids) - _hf_logits(hf, ids)).abs().max().item() <= TOL


def test_sliding_window_decode_matches_transformers(tmp_path):
    """Decode steps past the window read only the last `sliding_window` keys, as transformers does."""
    hf = write_tiny_model(tmp_path, "MistralForCausalLM", sliding_window=16)
    hf.config._attn_implementation = "eager"
    engine = FlashMemoryEngine(model_path=str(tmp_path), dtype="float32", kv_cache="contiguous")
    ids = torch.randint(3, engine.model_config.vocab_size, (40,), generator=torch.Generator().manual_seed(6)).tolist()
    engine.cache.add_sequence(7)
    try:
        steps = [engine.forward_tokens(7, ids[:20], all_logits=True)]
        steps += [engine.forward_tokens(7, [t]) for t in ids[20:]]
    finally:
        engine.cache.free_sequence(7)
    assert (torch.cat(steps) - _hf_logits(hf, ids)).abs().max().item() <= TOL
