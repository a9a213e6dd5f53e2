"""The engine's surface for tools: forward_tokens and check_prompt, and sessions and close on every
KV cache (a cache without sessions answers with a typed error naming the setting to change)."""

from __future__ import annotations

import pytest
import torch

from flashmemory import FlashMemoryEngine
from flashmemory.errors import ConfigError, PromptTooLongError, SessionsUnavailableError


@pytest.fixture(scope="module")
def exact(tiny_llama) -> FlashMemoryEngine:
    return FlashMemoryEngine(model_path=str(tiny_llama), kv_cache="contiguous", max_seq_len=64,
                             prefill_chunk_tokens=16)


def test_forward_tokens_returns_the_last_or_every_logits_across_chunks(exact):
    ids = list(range(3, 43))  # 40 tokens: three chunks of 16
    vocab = exact.model_config.vocab_size
    for seq_id, all_logits in ((1, True), (2, False)):
        exact.cache.add_sequence(seq_id)
        try:
            logits = exact.forward_tokens(seq_id, ids, all_logits=all_logits)
            assert exact.cache.num_tokens(seq_id) == len(ids)
        finally:
            exact.cache.free_sequence(seq_id)
        if all_logits:
            every = logits
            assert every.shape == (len(ids), vocab)
        else:
            assert logits.shape == (1, vocab)
            assert torch.allclose(logits[0], every[-1], atol=1e-5)


def test_forward_tokens_of_a_sequence_not_in_the_cache_names_add_sequence(exact):
    with pytest.raises(ConfigError, match=r"engine.cache.add_sequence\(5\)"):
        exact.forward_tokens(5, [3, 4])


def test_forward_tokens_refuses_a_token_outside_the_vocabulary(exact):
    exact.cache.add_sequence(3)
    try:
        with pytest.raises(ConfigError, match="outside the vocabulary"):
            exact.forward_tokens(3, [3, exact.model_config.vocab_size])
        with pytest.raises(ConfigError, match="empty"):
            exact.forward_tokens(3, [])
        assert exact.cache.num_tokens(3) == 0  # nothing reached the cache
    finally:
        exact.cache.free_sequence(3)


def test_forward_tokens_past_max_seq_len_raises_prompt_too_long(exact):
    exact.cache.add_sequence(4)
    try:
        exact.forward_tokens(4, [5] * 60)
        with pytest.raises(PromptTooLongError, match="64 tokens") as raised:
            exact.forward_tokens(4, [5] * 5)
        assert raised.value.num_prompt_tokens == 65 and exact.cache.num_tokens(4) == 60
    finally:
        exact.cache.free_sequence(4)


def test_check_prompt_raises_what_generate_raises(exact):
    exact.check_prompt([5] * 64)  # scoring may fill the context
    for bad, error in (([], ConfigError), ([5] * 64, PromptTooLongError), ([-1], ConfigError)):
        with pytest.raises(error) as from_check:
            exact.check_prompt(bad, max_new_tokens=1)
        with pytest.raises(error) as from_generate:
            exact.generate_token_ids(bad, max_new_tokens=1)
        assert str(from_check.value) == str(from_generate.value)


def test_sessions_of_the_contiguous_cache_raise_a_typed_error_naming_kv_cache(exact):
    for call in (lambda: exact.save_session("a", [3, 4]), lambda: exact.load_session("a"),
                 lambda: exact.delete_session("a")):
        with pytest.raises(SessionsUnavailableError, match="kv_cache='tiered'"):
            call()
    assert exact.sessions() == [] and exact.cache.flush_cache() == 0


def test_sessions_without_the_prefix_cache_raise_a_typed_error_naming_prefix_caching(tiny_llama):
    engine = FlashMemoryEngine(model_path=str(tiny_llama), prefix_caching=False,
                               cold_zone_enabled=False)
    try:
        with pytest.raises(SessionsUnavailableError, match="prefix_caching=True"):
            engine.save_session("a", [3, 4])
        assert engine.sessions() == []
    finally:
        engine.close()

