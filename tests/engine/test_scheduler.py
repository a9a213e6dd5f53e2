"""The scheduler (no torch): continuous batching, admission by KV memory per level, preemption that never drops."""

from __future__ import annotations

import random

import pytest

from flashmemory.engine.scheduler import Scheduler
from flashmemory.engine.sequence import Sequence, SequenceStatus
from flashmemory.kvcache.manager.blocks import Level
from flashmemory.kvcache.manager.capacity import KVCapacity
from flashmemory.kvcache.manager.policy import PlacementPolicy

BS = 16


def budget(device: int = 1000, host: int = 10_000, disk: int | None = 100_000, window: int = 64, warm: int = 64,
           max_num_seqs: int = 64) -> KVCapacity:
    capacity = {Level.DEVICE: device, Level.HOST: host}
    if disk is not None:
        capacity[Level.DISK] = disk
    return KVCapacity(PlacementPolicy(BS, window, warm, 1, cold_zone_enabled=disk is not None), capacity, max_num_seqs)


def seq(seq_id: int, prompt_len: int, max_tokens: int) -> Sequence:
    return Sequence(seq_id, list(range(3, 3 + prompt_len)), max_tokens)


def step(s: Scheduler) -> tuple:
    """One engine step as the worker runs it (the model 'samples' token 7); returns the plan and who finished."""
    plan = s.schedule()
    s.complete_step(plan)
    done = []
    for q, _ in plan.scheduled:
        if q.num_computed_tokens == q.num_tokens:
            q.output_ids.append(7)
            if len(q.output_ids) >= q.max_tokens:
                s.finish(q)
                done.append(q)
    return plan, done


def run_to_completion(s: Scheduler, max_steps: int = 20_000) -> list[tuple]:
    plans = []
    for _ in range(max_steps):
        if not s.has_work():
            return plans
        plan, _ = step(s)
        usage = s.usage()
        for level, used in usage.items():
            assert used <= s.budget.capacity_blocks[level], f"{level.name} over capacity"
        assert len(s.running) + len(s.parked) <= s.budget.max_num_seqs
        plans.append(plan)
    raise AssertionError("the scheduler did not finish (livelock)")


def test_requests_join_and_leave_the_batch_at_every_step():
    s = Scheduler(budget(), max_num_batched_tokens=512)
    a, b = seq(0, 20, 3), seq(1, 30, 5)
    s.add(a)
    plan, _ = step(s)
    assert [(q.seq_id, n) for q, n in plan.scheduled] == [(0, 20)] and plan.admitted == [a]
    s.add(b)  # joins while a is decoding
    plan, _ = step(s)
    assert [(q.seq_id, n) for q, n in plan.scheduled] == [(0, 1), (1, 30)]
    plan, done = step(s)
    assert done == [a] and a.status == SequenceStatus.FINISHED
    plan, _ = step(s)
    assert [q.seq_id for q, _ in plan.scheduled] == [1]  # a left the batch the step it finished


def test_admission_is_decided_by_the_memory_each_level_has_left():
    def admitted(device_blocks: int) -> int:
        s = Scheduler(budget(device=device_blocks), max_num_batched_tokens=10_000)
        for i in range(50):
            s.add(seq(i, 40, 10))  # 2 full blocks each in L0
        return len(s.schedule().admitted)

    # No fixed batch size: twice the device blocks admits about twice the sequences. Kept free on top: a 1 %
    # watermark and the 2 blocks a prefill commit holds for a moment (so it never displaces another window).
    assert admitted(11) == 4
    assert admitted(21) == 9
    assert admitted(1000) == 50


def test_the_filling_block_rows_bound_live_sequences():
    s = Scheduler(budget(max_num_seqs=3), max_num_batched_tokens=10_000)
    for i in range(5):
        s.add(seq(i, 10, 4))
    assert len(s.schedule().admitted) == 3
    run_to_completion(s)


def test_long_prompts_are_prefilled_in_chunks_next_to_decodes():
    s = Scheduler(budget(), max_num_batched_tokens=32)
    short, long = seq(0, 5, 20), seq(1, 100, 2)
    s.add(short)
    step(s)
    s.add(long)
    chunks = []
    for _ in range(4):
        plan, _ = step(s)
        assert plan.scheduled[0] == (short, 1)  # the decode is never held up by the prefill
        chunks.append(dict((q.seq_id, n) for q, n in plan.scheduled)[1])
    assert chunks == [31, 31, 31, 7] and sum(chunks) == 100


def test_device_pressure_demotes_the_newest_sequence_and_resumes_it_later():
    # L0 holds 12 blocks; each sequence grows to 4 window blocks + 1 sink, so 4 of them cannot all stay.
    s = Scheduler(budget(device=12, window=64), max_num_batched_tokens=512)
    seqs = [seq(i, 17, 100) for i in range(4)]
    for q in seqs:
        s.add(q)
    plans = run_to_completion(s)
    demoted = [q for p in plans for q in p.demoted]
    promoted = [q for p in plans for q in p.promoted]
    assert demoted and sorted(q.seq_id for q in promoted) == sorted(q.seq_id for q in demoted)
    assert not any(p.recomputed for p in plans)  # device pressure never throws KV away
    assert demoted[0] is seqs[-1]  # the most recently admitted goes first
    assert all(q.status == SequenceStatus.FINISHED and len(q.output_ids) == 100 for q in seqs)
    assert s.num_preemptions["demote"] == len(demoted)


def test_host_pressure_without_a_cold_zone_recomputes_and_keeps_generated_tokens():
    s = Scheduler(budget(device=1000, host=12, disk=None), max_num_batched_tokens=512)
    seqs = [seq(i, 20, 70) for i in range(3)]  # up to 89 committed tokens = 5 blocks each: 15 > 12
    for q in seqs:
        s.add(q)
    victim = None
    for _ in range(500):
        plan, _ = step(s)
        if plan.recomputed:
            victim = plan.recomputed[0]
            break
    assert victim is seqs[-1] and victim.status == SequenceStatus.WAITING and victim.num_computed_tokens == 0
    generated = list(victim.output_ids)
    assert generated and victim.num_pending_tokens == 20 + len(generated)  # prompt and output are prefilled again
    run_to_completion(s)
    assert victim.output_ids[: len(generated)] == generated
    assert all(len(q.output_ids) == 70 for q in seqs)


def test_abort_finds_a_sequence_wherever_it_is():
    s = Scheduler(budget(device=12), max_num_batched_tokens=512)
    seqs = [seq(i, 17, 100) for i in range(5)]
    for q in seqs:
        s.add(q)
    while not s.parked:
        step(s)
    parked, running, waiting = s.parked[0], s.running[0], (s.waiting[0] if s.waiting else None)
    for q in (parked, running, waiting):
        if q is not None:
            assert s.abort(q.seq_id) is q
    assert s.abort(parked.seq_id) is None
    assert parked not in s.parked and running not in s.running
    run_to_completion(s)


@pytest.mark.parametrize("seed", range(10))
def test_random_load_finishes_every_request_within_every_capacity(seed):
    rng = random.Random(seed)
    cold = rng.random() < 0.5
    s = Scheduler(budget(device=rng.randint(12, 40), host=rng.randint(20, 60), disk=10_000 if cold else None,
                         window=rng.choice([32, 64]), warm=32, max_num_seqs=rng.randint(2, 8)),
                  max_num_batched_tokens=rng.choice([16, 64, 256]))
    seqs = []
    for i in range(20):
        q = seq(i, rng.randint(1, 120), rng.randint(1, 60))
        if s.unfit_reason(q.num_tokens + q.max_tokens) is None:  # the server rejects the others with a 400
            seqs.append(q)
            s.add(q)
    run_to_completion(s)
    assert all(q.status == SequenceStatus.FINISHED and len(q.output_ids) == q.max_tokens for q in seqs)
