"""The engine core as the Python API drives it: batches, abandoned streams, interleaved streams."""

from __future__ import annotations

import pytest

from flashmemory import FlashMemoryEngine

PROMPTS = ["Alice was beginning", "The capital of France", "emoji and numbers 0123"]
TINY_KV = dict(block_size=8, active_window=16, warm_tokens=16, prefill_chunk_tokens=24, cpu_memory_gb=0.01,
               cold_zone_gb=0.01, kv_precision="fp16", selection="exact")


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return FlashMemoryEngine(model_path=str(tiny_llama), **TINY_KV)


def test_a_list_of_prompts_runs_as_one_batch_with_each_answer_as_alone(engine):
    alone = [engine.generate(p, max_new_tokens=20, ignore_eos=True) for p in PROMPTS]
    batched = engine.generate(PROMPTS, max_new_tokens=20, ignore_eos=True)
    assert batched == alone
    assert engine.last_stats.num_generated_tokens == 3 * 20
    assert engine.cache.sequence_ids() == []


def test_token_id_prompts_batch_too_and_one_token_list_is_one_prompt(engine):
    ids = [engine.tokenizer.encode(p) for p in PROMPTS[:2]]
    assert engine.generate(ids, max_new_tokens=5, ignore_eos=True) == [
        engine.generate(i, max_new_tokens=5, ignore_eos=True) for i in ids]
    assert isinstance(engine.generate(ids[0], max_new_tokens=5), str)


def test_token_ids_batch_like_texts(engine):
    alone = [engine.generate_token_ids(p, max_new_tokens=6, ignore_eos=True) for p in PROMPTS]
    assert engine.generate_token_ids(PROMPTS, max_new_tokens=6, ignore_eos=True) == alone


def test_a_stream_abandoned_early_frees_its_blocks(engine):
    stream = engine.stream(PROMPTS[0] * 5, max_new_tokens=50, ignore_eos=True)
    next(stream)
    assert engine.cache.sequence_ids() != []
    stream.close()
    assert engine.cache.sequence_ids() == [] and not engine.core.has_work()


def test_a_stream_never_started_holds_nothing(engine):
    stream = engine.stream(PROMPTS[0], max_new_tokens=5)
    assert engine.cache.sequence_ids() == [] and not engine.core.has_work()
    del stream


def test_two_streams_read_in_turns_each_get_their_own_text(engine):
    expected = [engine.generate(p, max_new_tokens=12, ignore_eos=True) for p in PROMPTS[:2]]
    a = engine.stream(PROMPTS[0], max_new_tokens=12, ignore_eos=True)
    b = engine.stream(PROMPTS[1], max_new_tokens=12, ignore_eos=True)
    texts = ["", ""]
    live = [a, b]
    while live:
        for i, s in enumerate([a, b]):
            if s in live:
                try:
                    texts[i] += next(s)
                except StopIteration:
                    live.remove(s)
    assert texts == expected


def test_a_long_prompt_reports_its_prefill_progress(engine):
    seen = []
    engine.generate("Alice was beginning to get very tired " * 12, max_new_tokens=2,
                    progress=lambda done, total: seen.append((done, total)))
    total = seen[-1][1]
    assert len(seen) >= 2 and seen[-1][0] == total and all(a[0] < b[0] for a, b in zip(seen, seen[1:]))


def test_a_progress_that_is_not_callable_is_refused(engine):
    from flashmemory.errors import ConfigError

    with pytest.raises(ConfigError, match="progress"):
        engine.generate("hi", progress=3)
