"""Prefix reuse through the engine: the same greedy text with and without the prefix cache, across chat turns and
for concurrent requests sharing a document, with the prefill of the shared part skipped.

The exact configuration (FP16 everywhere) is identical whatever the chunking. The tiered one reads INT4 copies of
the hot window, which turn float32 rounding differences into visible ones (see test_greedy_invariance_smollm2.py):
it is identical for the same placement: when the reused blocks kept their FP16 copy (they did not age into INT2
L2 in the first request: a block restored from L2 is as precise as its INT2 copy) and the prefill after the reused
prefix runs the same arithmetic as a fresh one (chunks of one block, so both runs split the prompt alike)."""

from __future__ import annotations

import pytest

from flashmemory import FlashMemoryEngine
from flashmemory.kvcache.manager.blocks import Level

EXACT = dict(kv_precision="fp16", selection="exact")
LEVELS = dict(block_size=8, active_window=32, warm_tokens=64, prefill_chunk_tokens=32, cpu_memory_gb=0.01,
              cold_zone_gb=0.01, max_num_seqs=4)
DOCUMENT = "Alice was beginning to get very tired of sitting by her sister on the bank. " * 4


@pytest.fixture(params=["exact", "tiered"])
def engines(request, tiny_llama, tmp_path):
    same_placement = {"prefill_chunk_tokens": LEVELS["block_size"], "warm_tokens": 1024, "cpu_memory_gb": 0.05}
    knobs = dict(LEVELS, **(EXACT if request.param == "exact" else same_placement))
    with_cache = FlashMemoryEngine(model_path=str(tiny_llama), cold_zone_dir=str(tmp_path / "a"), **knobs)
    without = FlashMemoryEngine(model_path=str(tiny_llama), cold_zone_dir=str(tmp_path / "b"), prefix_caching=False,
                                **knobs)
    yield with_cache, without
    with_cache.close()
    without.close()


def test_the_same_document_asked_twice_reuses_its_prefill_and_answers_the_same(engines):
    cached, plain = engines
    questions = [DOCUMENT + " Question: who was tired?", DOCUMENT + " Question: where was she sitting?"]
    for q in questions:
        assert cached.generate(q, max_new_tokens=16, ignore_eos=True) == plain.generate(q, max_new_tokens=16,
                                                                                          ignore_eos=True)
    stats = cached.stats()
    assert stats["prefix_cache_hits"] >= len(cached.tokenizer.encode(DOCUMENT)) - 2 * LEVELS["block_size"]
    assert plain.stats().get("prefix_cache_hits", 0) == 0


def test_a_chat_s_next_turn_reuses_its_history(engines):
    cached, plain = engines
    history = [{"role": "user", "content": DOCUMENT[: len(DOCUMENT) // 3]}]  # three turns fit the tiny context
    for turn in range(3):
        answers = [e.chat(history, max_new_tokens=12, ignore_eos=True) for e in (cached, plain)]
        assert answers[0] == answers[1], f"turn {turn}"
        history += [{"role": "assistant", "content": answers[0]}, {"role": "user", "content": f"And then {turn}?"}]
    assert cached.stats()["prefix_cache_hit_rate"] > 0.4  # the first turn is all misses, the next two mostly hits


def test_concurrent_requests_sharing_a_document_share_its_blocks(engines):
    cached, plain = engines
    prompts = [DOCUMENT + f" Question {i}: what happened next?" for i in range(3)]
    cached.generate(DOCUMENT, max_new_tokens=1)  # the document's blocks are cached
    assert cached.generate(prompts, max_new_tokens=10, ignore_eos=True) == plain.generate(
        prompts, max_new_tokens=10, ignore_eos=True)
    assert cached.stats()["prefix_cache_hits"] >= 3 * (len(cached.tokenizer.encode(DOCUMENT)) // 8 - 1) * 8
    assert cached.cache.sequence_ids() == []


def test_blocks_pushed_out_of_l1_are_computed_again_not_read_at_int2(tiny_llama, tmp_path):
    """Unused cached blocks beyond prefix_cache_host_mb keep only their INT2 copy. The same prompt again must not read
    them at INT2 where a fresh prefill keeps FP16 (the needle suite lost answers to that): it computes them again."""
    knobs = dict(LEVELS, prefill_chunk_tokens=LEVELS["block_size"], warm_tokens=1024, cpu_memory_gb=0.05,
                 prefix_cache_host_mb=0)
    cached = FlashMemoryEngine(model_path=str(tiny_llama), cold_zone_dir=str(tmp_path / "a"), **knobs)
    plain = FlashMemoryEngine(model_path=str(tiny_llama), cold_zone_dir=str(tmp_path / "b"), prefix_caching=False,
                              **knobs)
    try:
        question = DOCUMENT + " Question: who was tired?"
        want = plain.generate(question, max_new_tokens=16, ignore_eos=True)
        assert cached.generate(question, max_new_tokens=16, ignore_eos=True) == want
        pushed = [b for b in cached.cache.prefix_cache.index.values() if b.master_lost]
        assert pushed and all(Level.HOST not in b.slots for b in pushed)
        assert cached.generate(question, max_new_tokens=16, ignore_eos=True) == want
        stats = cached.stats()
        assert stats["prefix_cache_hits"] == 0 and stats["prefix_cache_lossy_refusals"] >= 1
    finally:
        cached.close()
        plain.close()


def test_the_same_long_prompt_again_reuses_blocks_its_answer_aged_onto_l2(tiny_llama, tmp_path):
    """The answer's growth ages the prompt's oldest L1 blocks onto L2. Their FP16 masters are kept
    for the prefix cache, so the same prompt again reuses every full block instead of computing the
    L1 part again."""
    knobs = dict(LEVELS, prefill_chunk_tokens=LEVELS["block_size"], active_window=16,
                 warm_tokens=32)
    cached = FlashMemoryEngine(model_path=str(tiny_llama), cold_zone_dir=str(tmp_path / "a"),
                               **knobs)
    plain = FlashMemoryEngine(model_path=str(tiny_llama), cold_zone_dir=str(tmp_path / "b"),
                              prefix_caching=False, **knobs)
    try:
        question = DOCUMENT + " Question: who was tired?"
        n = len(cached.tokenizer.encode(question))
        # it reaches L2
        assert n > knobs["active_window"] + knobs["warm_tokens"] + 4 * LEVELS["block_size"]
        want = plain.generate(question, max_new_tokens=24, ignore_eos=True)
        assert cached.generate(question, max_new_tokens=24, ignore_eos=True) == want
        assert cached.generate(question, max_new_tokens=24, ignore_eos=True) == want
        stats = cached.stats()
        assert stats["prefix_cache_lossy_refusals"] == 0
        assert stats["prefix_cache_hits"] >= (n - 1) // LEVELS["block_size"] * LEVELS["block_size"]
        # every kept slot went back to its block on release
        assert not cached.cache.blocks.kept_masters
    finally:
        cached.close()
        plain.close()
