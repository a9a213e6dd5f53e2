"""A fault on the prefix-reuse path (admission) is contained as on the decode path: the block that
cannot be read leaves the prefix cache, counted by reason, the sequence is computed again without
it (once) or fails alone, and every other sequence and the engine go on."""

from __future__ import annotations

import time

import pytest

from flashmemory import FlashMemoryEngine
from flashmemory.engine.request import SequenceRequest
from flashmemory.engine.sampling import SamplingParams
from flashmemory.errors import CapacityError
from flashmemory.kvcache.manager.blocks import Level

# fp16 on every level and exact selection: a recomputed answer equals the reused one, token for
# token.
KV = dict(
    block_size=8,
    active_window=16,
    warm_tokens=16,
    prefill_chunk_tokens=24,
    cpu_memory_gb=0.01,
    cold_zone_gb=0.01,
    kv_precision="fp16",
    selection="exact",
    max_num_seqs=4,
    recent_fp16_tokens=0,
    prefix_cache_host_mb=0,  # no L1 room for cached blocks: a document's head waits on L2 only
)
DOCUMENT = "Alice was beginning to get very tired of sitting by her sister on the bank " * 3
QUESTION = DOCUMENT + "What was Alice doing?"
OTHER = "The capital of France"


def _engine(tiny_llama, folder, **extra) -> FlashMemoryEngine:
    return FlashMemoryEngine(
        model_path=str(tiny_llama), cold_zone_dir=str(folder), **{**KV, **extra}
    )


@pytest.fixture
def engine(tiny_llama, tmp_path):
    e = _engine(tiny_llama, tmp_path)
    yield e
    e.close()


def _run(engine, prompts: list[str], max_tokens: int) -> dict[int, list]:
    """Drive the core with one request per prompt, all admitted in the same step."""
    core = engine.core
    outs: dict[int, list] = {i: [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        params = SamplingParams(max_new_tokens=max_tokens, ignore_eos=True)
        core.add(
            SequenceRequest(i, engine.tokenizer.encode(p), params, time.perf_counter()),
            outs[i].append,
        )
    while core.has_work():
        for sink, out in core.step():
            sink(out)
    return outs


def _text(outs: list) -> str:
    return "".join(o.text for o in outs)


def _cold_cached_blocks(engine) -> list:
    """Cached blocks whose only copy is their L2 record (a reuse reads it for its digest)."""
    return [b for b in engine.cache.prefix_cache.index.values() if set(b.slots) == {Level.DISK}]


def _corrupt(engine, block) -> None:
    pool = engine.cache.disk_pool
    with open(pool.path, "r+b") as f:
        f.seek(block.slots[Level.DISK] * pool.record_bytes + pool.header_bytes + 3)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))


def test_a_corrupt_block_of_a_reused_prefix_is_dropped_and_the_sequence_recomputed(
    engine, tiny_llama, tmp_path
):
    reference = _engine(tiny_llama, tmp_path / "ref", prefix_caching=False)
    expected = [
        reference.generate(p, max_new_tokens=12, ignore_eos=True) for p in (QUESTION, OTHER)
    ]
    reference.close()
    engine.generate(
        DOCUMENT, max_new_tokens=2, ignore_eos=True
    )  # caches the document, its head aged to L2
    cold = _cold_cached_blocks(engine)
    assert cold, "the document's old blocks should be cached on L2 only"
    _corrupt(engine, cold[len(cold) // 2])

    outs = _run(engine, [QUESTION, OTHER], 12)

    assert [_text(outs[0]), _text(outs[1])] == expected
    assert not any(o.error for o in outs[0] + outs[1])
    stats = engine.stats()
    assert stats["prefix_cache_bad_blocks_checksum"] == 1 and stats["prefix_cache_bad_blocks"] == 1
    assert stats["L2_load_failures_checksum"] >= 1
    assert engine.cache.sequence_ids() == []
    # the engine goes on, and the blocks before the bad one are still reused
    assert engine.generate(QUESTION, max_new_tokens=12, ignore_eos=True) == expected[0]


def test_an_unexpected_error_while_admitting_fails_that_sequence_alone(engine, monkeypatch):
    expected_other = engine.generate(OTHER, max_new_tokens=12, ignore_eos=True)
    engine.generate(DOCUMENT, max_new_tokens=2, ignore_eos=True)
    cache = engine.cache
    real_reuse = cache.reuse_prefix
    document = engine.tokenizer.encode(DOCUMENT)[:8]

    def broken(seq_id, token_ids):
        found = real_reuse(seq_id, token_ids)
        if token_ids[:8] == document:  # not a fault that computing again repairs
            raise RuntimeError("an internal bookkeeping bug")
        return found

    monkeypatch.setattr(cache, "reuse_prefix", broken)

    outs = _run(engine, [QUESTION, OTHER], 12)

    assert outs[0][-1].error is not None and "server log" in outs[0][-1].error
    assert _text(outs[1]) == expected_other and outs[1][-1].finish_reason == "length"
    assert engine.cache.sequence_ids() == [] and engine.stats()["L1_blocks"] == 0
    monkeypatch.undo()
    assert engine.generate("hi", max_new_tokens=3)  # the engine goes on


def test_a_full_level_while_restoring_a_prefix_recomputes_it_without_the_cache(
    engine, tiny_llama, tmp_path, monkeypatch
):
    reference = _engine(tiny_llama, tmp_path / "ref", prefix_caching=False)
    expected = reference.generate(QUESTION, max_new_tokens=12, ignore_eos=True)
    reference.close()
    engine.generate(DOCUMENT, max_new_tokens=2, ignore_eos=True)
    calls = []

    def full(seq_id, index):
        calls.append(index)
        raise CapacityError("L1 is full: raise cpu_memory_gb")

    monkeypatch.setattr(engine.cache.placement, "restore_block", full)
    outs = _run(engine, [QUESTION], 12)

    assert _text(outs[0]) == expected and not outs[0][-1].error
    assert len(calls) == 1  # the second admission did not touch the prefix cache
    assert engine.stats()["prefix_cache_blocks"] > 0  # nothing good was thrown away
    assert engine.cache.sequence_ids() == []


def test_a_restart_with_a_corrupt_cold_record_recomputes_instead_of_stopping(tiny_llama, tmp_path):
    knobs = dict(persist_cache=True, active_window=32, warm_tokens=32)
    first = _engine(tiny_llama, tmp_path, **knobs)
    expected = first.generate(QUESTION, max_new_tokens=12, ignore_eos=True)
    first.close()
    second = _engine(tiny_llama, tmp_path, **knobs)
    prefix = second.cache.prefix_cache.match(second.tokenizer.encode(QUESTION), count=False)
    assert prefix and set(prefix[0].slots) == {Level.DISK}, "recovered blocks are on L2 only"
    _corrupt(second, prefix[-1])  # in the new window: restored to L1 and L0 by the reuse

    outs = _run(second, [QUESTION, OTHER], 12)

    assert _text(outs[0]) == expected and not any(o.error for o in outs[0] + outs[1])
    assert second.stats()["prefix_cache_bad_blocks"] == 1
    second.close()
