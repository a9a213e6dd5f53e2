"""The engine over the tiered cache on a tiny model: exact when nothing is lossy, budgets hold, all three levels are used."""

from __future__ import annotations

import pytest
import torch

from flashmemory import FlashMemoryEngine
from flashmemory.errors import EngineBusyError
from flashmemory.kvcache.manager.blocks import Level
from flashmemory.kvcache.contiguous import ContiguousKVCache

TINY_LEVELS = dict(block_size=8, active_window=16, warm_tokens=16, prefill_chunk_tokens=24, cpu_memory_gb=0.01,
                   cold_zone_gb=0.01)


def _teacher_forced_logits(engine, ids: list[int], prefill: int) -> torch.Tensor:
    """Prefill `prefill` tokens (chunked), then one token at a time; logits of every position."""
    seq = 12345
    engine.cache.add_sequence(seq)
    try:
        steps = [engine.forward_tokens(seq, ids[:prefill], all_logits=True)]
        steps += [engine.forward_tokens(seq, [t]) for t in ids[prefill:]]
    finally:
        engine.cache.free_sequence(seq)
    return torch.cat(steps)


@pytest.fixture(scope="module")
def ids(tiny_llama) -> list[int]:
    return torch.randint(3, 300, (120,), generator=torch.Generator().manual_seed(0)).tolist()


def test_fp16_exact_selection_over_three_levels_equals_the_contiguous_cache(tiny_llama, ids):
    tiered = FlashMemoryEngine(model_path=str(tiny_llama), kv_precision="fp16", selection="exact", **TINY_LEVELS)
    exact = FlashMemoryEngine(model_path=str(tiny_llama), kv_cache="contiguous", kv_precision="fp16")
    assert isinstance(exact.cache, ContiguousKVCache) and exact.cache.dtype == torch.float16
    ours = _teacher_forced_logits(tiered, ids, prefill=70)
    reference = _teacher_forced_logits(exact, ids, prefill=70)
    assert (ours - reference).abs().max().item() <= 1e-4
    moved = tiered.stats()
    assert moved["bytes_moved_L0->L1"] > 0 and moved["bytes_moved_L1->L2"] > 0  # all three levels were used


def test_fp16_exact_selection_equals_contiguous_on_smollm2(smollm2_path, alice_text):
    # float64 compute: SmolLM2's float32 logits move by ~1e-2 under any change of summation order (even the
    # contiguous cache against itself with another prefill chunk size), so 1e-4 is checked where it means exact.
    small = dict(dtype="float64", block_size=16, active_window=64, warm_tokens=64, prefill_chunk_tokens=128, cpu_memory_gb=0.1,
                 cold_zone_gb=0.1)
    tiered = FlashMemoryEngine(model_path=str(smollm2_path), kv_precision="fp16", selection="exact", **small)
    exact = FlashMemoryEngine(model_path=str(smollm2_path), kv_cache="contiguous", kv_precision="fp16",
                              dtype="float64", prefill_chunk_tokens=128)  # the same chunks
    ids = tiered.tokenizer.encode(alice_text[3000:6000])[:300]
    ours = _teacher_forced_logits(tiered, ids, prefill=290)
    reference = _teacher_forced_logits(exact, ids, prefill=290)
    assert (ours - reference).abs().max().item() <= 1e-4
    assert tiered.stats()["bytes_moved_L1->L2"] > 0


def test_mixed_precision_with_selection_stays_close(tiny_llama, ids):
    tiered = FlashMemoryEngine(model_path=str(tiny_llama), semantic_truncate_threshold=0.5, warm_budget_tokens=8,
                               selection_min_tokens=0, **TINY_LEVELS)
    exact = FlashMemoryEngine(model_path=str(tiny_llama), kv_cache="contiguous")
    ours = torch.softmax(_teacher_forced_logits(tiered, ids, prefill=70), -1)
    reference = torch.softmax(_teacher_forced_logits(exact, ids, prefill=70), -1)
    assert (ours - reference).abs().sum(-1).max().item() < 0.5  # total variation per position
    s = tiered.stats()
    assert 0 < s["L2_selected_fraction"] < 1 and 0 < s["L1_selected_fraction"] <= 1


def test_device_pool_never_exceeds_its_capacity_with_several_sequences(tiny_llama):
    engine = FlashMemoryEngine(model_path=str(tiny_llama), max_num_seqs=3, **TINY_LEVELS)
    cache = engine.cache
    capacity = cache.device_bytes_capacity()
    prompts = [list(range(3, 3 + n)) for n in (10, 41, 77)]
    for i, p in enumerate(prompts):
        cache.add_sequence(i)
        engine.forward_tokens(i, p)
    for step in range(60):
        for i in range(3):
            engine.forward_tokens(i, [5 + step % 7])
            assert cache.device_bytes_used() <= capacity
            assert cache.blocks.allocators[Level.DEVICE].num_used <= cache.cfg.device_slots
    engine.clear_cache()
    s = engine.stats()
    assert s["L0_blocks"] == s["L1_blocks"] == s["L2_blocks"] == 0 and s["num_sequences"] == 0


def test_budget_too_small_for_weights_and_window_gives_the_startup_message(tiny_llama):
    from flashmemory.errors import MemoryBudgetError

    with pytest.raises(MemoryBudgetError) as e:
        FlashMemoryEngine(model_path=str(tiny_llama), max_gpu_memory_mb=1, active_window=2048)
    msg = str(e.value)
    for part in ("max_gpu_memory_mb=1 is too small", "weights need", "active_window=2048",
                 "The largest active_window that fits", "Raise max_gpu_memory_mb to at least"):
        assert part in msg


def test_host_level_full_without_cold_zone_says_so(tiny_llama):
    from flashmemory.errors import CapacityError

    engine = FlashMemoryEngine(model_path=str(tiny_llama), cold_zone_enabled=False, block_size=8, active_window=16,
                               cpu_memory_gb=2e-5)
    with pytest.raises(CapacityError, match="host KV pool is full.*cold_zone_enabled=True"):
        engine.generate(list(range(3, 200)), max_new_tokens=2)
    assert engine.cache.sequence_ids() == []


def test_pinned_span_stays_in_device_memory_and_late_pins_are_promoted(tiny_llama):
    engine = FlashMemoryEngine(model_path=str(tiny_llama), **TINY_LEVELS)
    cache = engine.cache
    cache.add_sequence(1)
    cache.pin_span(1, 8, 24)  # blocks 1 and 2 (block_size 8); block 0 is the attention sink
    engine.forward_tokens(1, list(range(3, 100)))
    table = cache.blocks.tables[1]
    on_device = [i for i, b in enumerate(table.blocks) if Level.DEVICE in b.slots]
    window = TINY_LEVELS["active_window"] // TINY_LEVELS["block_size"]
    assert on_device == [0, 1, 2] + list(range(len(table.blocks) - window, len(table.blocks)))
    # Pinning a span that already left for L1 promotes it back, re-quantized from the FP16 master copy.
    cache.pin_span(1, 64, 72)  # block 8: left the window, still in the warm span (L1)
    block = table.blocks[8]
    assert Level.DEVICE in block.slots and block.pinned
    host = cache.codecs[Level.HOST].decode(cache.host_pool.get_block(block.slots[Level.HOST]), torch.float16)
    expected = cache.codecs[Level.DEVICE].encode(*host)
    got = cache.device_pool.get_block(block.slots[Level.DEVICE])
    assert all(torch.equal(got[name], expected[name]) for name in expected)
    cache.free_sequence(1)


def test_chat_can_pin_the_system_prompt(tiny_llama):
    engine = FlashMemoryEngine(model_path=str(tiny_llama), **TINY_LEVELS)
    messages = [{"role": "system", "content": "You answer in one word. " * 3}, {"role": "user", "content": "hi"}]
    engine.chat(messages, max_new_tokens=30, ignore_eos=True, pin_system_prompt=True)
    assert engine.last_kv_stats["L0_blocks"] > TINY_LEVELS["active_window"] // TINY_LEVELS["block_size"] + 1


def test_invalid_pinned_span_is_rejected(tiny_llama):
    from flashmemory.errors import ConfigError

    engine = FlashMemoryEngine(model_path=str(tiny_llama), **TINY_LEVELS)
    with pytest.raises(ConfigError, match="pinned_spans"):
        engine.generate("hello", pinned_spans=[(5, 2)])


def test_two_sequences_in_one_batch_match_running_them_alone(tiny_llama):
    from flashmemory.kvcache.interface import ForwardBatch

    knobs = dict(kv_precision="fp16", selection="exact", **TINY_LEVELS)
    engine = FlashMemoryEngine(model_path=str(tiny_llama), **knobs)
    gen = torch.Generator().manual_seed(3)
    a = torch.randint(3, 300, (60,), generator=gen).tolist()
    b = torch.randint(3, 300, (45,), generator=gen).tolist()
    alone_a = _teacher_forced_logits(engine, a, prefill=50)
    alone_b = _teacher_forced_logits(engine, b, prefill=45)
    cache = engine.cache
    cache.add_sequence(1)
    cache.add_sequence(2)
    first_a = engine.forward_tokens(1, a[:50], all_logits=True)
    # One batch: a decode step of sequence 1 and the whole prompt of sequence 2 (chunk larger than a block).
    batch = ForwardBatch.build([(1, 50, 1), (2, 0, 45)], engine.device)
    logits = engine.model(torch.tensor([a[50]] + b), cache, batch)
    cache.commit(batch)
    assert (torch.cat([first_a, logits[:1]]) - alone_a[:51]).abs().max() <= 1e-4
    assert (logits[1:] - alone_b).abs().max() <= 1e-4
    assert cache.num_tokens(1) == 51 and cache.num_tokens(2) == 45
    engine.clear_cache()


def _assert_no_kv_held(engine) -> None:
    s = engine.stats()
    for level in range(3):
        assert s[f"L{level}_blocks"] == s[f"L{level}_cached_blocks"] == 0, level
    assert s["prefix_cache_blocks"] == 0 and s["num_sequences"] == 0 and s["L0_bytes"] == 0
    assert all(a.num_used == 0 for a in engine.cache.blocks.allocators.values())


def test_clear_cache_during_stream_fails_cleanly_and_frees_blocks(tiny_llama):
    engine = FlashMemoryEngine(model_path=str(tiny_llama), **TINY_LEVELS)
    prompt = list(range(3, 83))  # 80 tokens: blocks on all three levels (window 16, warm 16)
    stream = engine.stream(prompt, max_new_tokens=12, ignore_eos=True)
    next(stream)
    with pytest.raises(EngineBusyError, match=r"1 sequence.*sequence id 0.*close\(\)"):
        engine.clear_cache()
    list(stream)  # the refusal left the stream alone: it runs to its end
    assert engine.last_stats.num_generated_tokens == 12
    assert engine.last_stats.finish_reason == "length"
    held = engine.stats()
    # The prefix cache kept the finished sequence's blocks, on every level.
    assert all(held[f"L{level}_cached_blocks"] > 0 for level in range(3))
    engine.clear_cache()
    _assert_no_kv_held(engine)
    # The engine goes on serving, and the cleared prefix is computed again (no hit).
    engine.generate(prompt, max_new_tokens=2)
    assert engine.stats()["prefix_cache_hits"] == held["prefix_cache_hits"]


def test_clear_cache_after_closing_a_stream_midway_frees_everything(tiny_llama):
    engine = FlashMemoryEngine(model_path=str(tiny_llama), **TINY_LEVELS)
    stream = engine.stream(list(range(3, 83)), max_new_tokens=12, ignore_eos=True)
    next(stream)
    stream.close()
    engine.clear_cache()
    _assert_no_kv_held(engine)


def test_reconfigure_kv_during_stream_is_refused_and_the_stream_goes_on(tiny_llama):
    engine = FlashMemoryEngine(model_path=str(tiny_llama), **TINY_LEVELS)
    stream = engine.stream(list(range(3, 40)), max_new_tokens=6, ignore_eos=True)
    next(stream)
    with pytest.raises(EngineBusyError, match="reconfigure_kv"):
        engine.reconfigure_kv(**TINY_LEVELS, kv_precision="fp16")
    list(stream)
    assert engine.last_stats.num_generated_tokens == 6
    engine.reconfigure_kv(**TINY_LEVELS, kv_precision="fp16")
    assert engine.config.kv_precision == "fp16"


def test_clear_cache_keeps_saved_sessions(tiny_llama):
    engine = FlashMemoryEngine(model_path=str(tiny_llama), **TINY_LEVELS)
    engine.generate(list(range(3, 43)), max_new_tokens=4, ignore_eos=True)
    kept = engine.save_session("chat")
    engine.generate(list(range(100, 140)), max_new_tokens=4, ignore_eos=True)  # unsaved
    engine.clear_cache()
    s = engine.stats()
    assert s["prefix_cache_blocks"] == kept // engine.cache.cfg.block_size
    assert all(s[f"L{level}_cached_blocks"] == 0 for level in range(3))
    before = s["prefix_cache_hits"]
    engine.generate(engine.load_session("chat") + [7], max_new_tokens=1)
    assert engine.stats()["prefix_cache_hits"] - before == kept
