"""No fault takes the engine down: a failure while serving one sequence fails or recomputes that sequence only,
the others finish with the text they give alone, and the engine goes on."""

from __future__ import annotations

import time

import pytest

from flashmemory import FlashMemoryEngine
from flashmemory.engine.request import SequenceRequest
from flashmemory.engine.sampling import SamplingParams

KV = dict(block_size=8, active_window=16, warm_tokens=16, prefill_chunk_tokens=24, cpu_memory_gb=0.01,
          cold_zone_gb=0.01, kv_precision="fp16", selection="exact", max_num_seqs=4)
LONG = "Alice was beginning to get very tired of sitting by her sister on the bank " * 2


@pytest.fixture
def engine(tiny_llama, tmp_path):
    e = FlashMemoryEngine(model_path=str(tiny_llama), cold_zone_dir=str(tmp_path), **KV)
    yield e
    e.close()


def _run(engine, prompts: list[str], max_tokens: int, sabotage=None) -> dict[int, list]:
    """Drive the core with one request per prompt; `sabotage(core, step)` runs before each step."""
    core = engine.core
    outs: dict[int, list] = {i: [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        params = SamplingParams(max_new_tokens=max_tokens, ignore_eos=True)
        core.add(SequenceRequest(i, engine.tokenizer.encode(p), params, time.perf_counter()), outs[i].append)
    step = 0
    while core.has_work():
        if sabotage is not None:
            sabotage(core, step)
        for sink, out in core.step():
            sink(out)
        step += 1
    return outs


def _text(outs: list) -> str:
    return "".join(o.text for o in outs)


def _corrupt_cold_blocks(engine) -> None:
    pool = engine.cache.disk_pool
    with open(pool.path, "r+b") as f:
        for slot in list(pool._crcs):
            f.seek(slot * pool.record_bytes + pool.header_bytes + 3)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0xFF]))


def test_a_corrupt_cold_block_recomputes_its_sequence_and_spares_the_other(engine):
    alone = [engine.generate(p, max_new_tokens=30, ignore_eos=True) for p in (LONG, "The capital of France")]
    done = []

    def corrupt_once(core, step):
        if step == 12 and not done and engine.cache.disk_pool._crcs:
            _corrupt_cold_blocks(engine)
            done.append(step)

    outs = _run(engine, [LONG, "The capital of France"], 30, corrupt_once)
    assert done  # the fault happened while both were decoding
    assert [_text(outs[0]), _text(outs[1])] == alone  # recomputed from its tokens: the same text
    assert not any(o.error for o in outs[0] + outs[1])
    stats = engine.stats()
    assert stats["L2_load_failures_checksum"] >= 1 and engine.cache.sequence_ids() == []


def test_a_sequence_that_faults_again_after_its_recompute_fails_alone(engine):
    alone = engine.generate("The capital of France", max_new_tokens=30, ignore_eos=True)

    def corrupt_always(core, step):
        if step > 8 and engine.cache.disk_pool._crcs:
            _corrupt_cold_blocks(engine)

    outs = _run(engine, [LONG, "The capital of France"], 30, corrupt_always)
    assert outs[0][-1].error is not None and "checksum" in outs[0][-1].error
    assert _text(outs[1]) == alone and outs[1][-1].finish_reason == "length"
    assert engine.cache.sequence_ids() == []
    assert engine.generate("hi", max_new_tokens=3)  # the engine goes on


def test_a_sampling_failure_ends_that_sequence_only(engine):
    alone = engine.generate("The capital of France", max_new_tokens=10, ignore_eos=True)

    def break_sampler(core, step):
        live = next((lv for lv in core._live.values() if lv.request.index == 0), None)
        if step == 3 and live is not None:
            def boom(logits):
                raise RuntimeError("nan in the distribution")
            live.request.params = SamplingParams(max_new_tokens=10, temperature=0.7, ignore_eos=True)
            live.sampler.sample = boom

    outs = _run(engine, [LONG, "The capital of France"], 10, break_sampler)
    assert outs[0][-1].error is not None and "server log" in outs[0][-1].error
    assert _text(outs[1]) == alone
    assert engine.cache.sequence_ids() == []


def test_greedy_text_is_the_same_alone_batched_and_at_three_chunk_sizes(tiny_llama, tmp_path):
    # L0 is INT4 (mixed precision) and the window small, so a prompt's later prefill chunks read earlier blocks that
    # also have an L0 copy: they must read the FP16 copy, or the text would depend on the chunking.
    knobs = dict(block_size=8, active_window=16, warm_tokens=512, cpu_memory_gb=0.01, cold_zone_dir=str(tmp_path))
    prompts = [LONG, "The capital of France is", "Caf\u00e9 cr\u00e8me and na\u00efve r\u00e9sum\u00e9 " * 4]
    texts = {}
    for chunk in (8, 24, 200):
        engine = FlashMemoryEngine(model_path=str(tiny_llama), prefill_chunk_tokens=chunk, **knobs)
        texts[("alone", chunk)] = [engine.generate(p, max_new_tokens=24, ignore_eos=True) for p in prompts]
        texts[("batched", chunk)] = engine.generate(prompts, max_new_tokens=24, ignore_eos=True)
        engine.close()
    reference = texts[("alone", 200)]
    assert all(t == reference for t in texts.values()), texts
