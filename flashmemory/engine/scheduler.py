"""Scheduler: continuous batching over the KV levels — who runs this step, who waits, who is preempted (no torch).

Every step each running sequence gets its pending tokens (1 when decoding, a chunk when prefilling) within a
token budget; waiting sequences join as soon as every KV level has room for them, and finished ones leave.
There is no fixed batch size: admission and preemption are decided by the blocks each level has left
(KVCapacity, which counts them with the cache's own PlacementPolicy). When a step would overflow a level,
the scheduling policy's victim (by default the most recently admitted sequence) is preempted:

- L0 (device) full: it is *demoted* — its L0 copies are dropped (its FP16 copies stay in L1, the rest in L2)
  and it is parked; it resumes, promoted back to L0 from the FP16 copies, once L0 has room again.
- L1 or L2 full: its blocks are freed on every level and it waits at the head of the queue; on resuming, its
  prompt and the tokens it already generated are prefilled again (recompute).

Either way its generated tokens are kept: a preempted request is resumed, never dropped.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from flashmemory.engine.scheduling_policy import FCFS, SchedulingPolicy
from flashmemory.engine.sequence import Sequence, SequenceStatus
from flashmemory.kvcache.manager.blocks import Level
from flashmemory.kvcache.manager.capacity import KVCapacity


@dataclass
class StepPlan:
    """One step's decisions, applied to the cache in field order before the forward."""

    demoted: list[Sequence] = field(default_factory=list)  # drop their L0 copies (park them)
    recomputed: list[Sequence] = field(default_factory=list)  # free them on every level (they wait again)
    promoted: list[Sequence] = field(default_factory=list)  # parked ones resuming: restore their L0 copies
    admitted: list[Sequence] = field(default_factory=list)  # new to the cache: add them
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, new tokens) in batch order

    @property
    def num_preempted(self) -> int:
        return len(self.demoted) + len(self.recomputed)


class Scheduler:
    """Owns the waiting queue, the running batch and the parked (demoted) sequences."""

    def __init__(self, budget: KVCapacity, max_num_batched_tokens: int, policy: SchedulingPolicy = FCFS) -> None:
        if max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")  # internal: the server validates its config
        self.budget = budget  # the KV levels' capacity, checked before every step
        self.policy = policy  # who is admitted next and who is preempted first
        self.max_num_batched_tokens = max_num_batched_tokens  # tokens of one forward (decodes + prefill chunks)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last one is preempted first
        self.parked: list[Sequence] = []  # preemption order: the first one resumes first
        self.num_preemptions = {"demote": 0, "recompute": 0}
        self._step_new_blocks = 0  # the most blocks one scheduled sequence completes this step (see _reserve)

    # ---- lifecycle --------------------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def abort(self, seq_id: int) -> Sequence | None:
        """Remove the sequence wherever it is; returns it (its status says whether the cache holds it)."""
        for queue in (self.running, self.parked, self.waiting):
            for seq in queue:
                if seq.seq_id == seq_id:
                    queue.remove(seq)
                    return seq
        return None

    def requeue(self, seq: Sequence) -> None:
        """Its KV is gone (freed after a fault): wait at the head of the queue to be prefilled again, tokens kept."""
        for queue in (self.running, self.parked):
            if seq in queue:
                queue.remove(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.status = SequenceStatus.FINISHED

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.parked)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Sequences not in the batch: never admitted, preempted by recompute, or parked."""
        return len(self.waiting) + len(self.parked)

    def unfit_reason(self, num_tokens: int, pinned_spans: tuple[tuple[int, int], ...] = ()) -> str | None:
        """Why a sequence that may reach `num_tokens` tokens can never run here, even alone; None when it can."""
        reserve = {}
        if self.budget.cold_zone_enabled:  # the largest transient of one step (see _reserve)
            reserve[Level.HOST] = (self.budget.block_size - 1 + self.max_num_batched_tokens) // self.budget.block_size
        return self.budget.unfit_reason(num_tokens, reserve, pinned_spans)

    def usage(self) -> dict[Level, int]:
        """Blocks per level the resident sequences hold now (by the budget's placement model)."""
        return self.budget.usage([s.load() for s in self.running] + [s.load(on_device=False) for s in self.parked])

    # ---- one step ---------------------------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        self._step_new_blocks = 0
        tokens_left = self.max_num_batched_tokens
        projected: dict[int, int] = {}  # seq_id -> committed tokens after this step, for the scheduled ones
        i = 0
        while i < len(self.running) and tokens_left > 0:
            seq = self.running[i]
            n = min(seq.num_pending_tokens, tokens_left)
            if not self._make_room(seq, n, projected, plan):
                break  # `seq` itself was preempted, and every sequence after it before that
            self._schedule(seq, n, projected, plan)
            tokens_left -= n
            i += 1
        if plan.num_preempted == 0:
            # Nothing joins in a step that had to preempt: the newcomer would be the next victim.
            tokens_left = self._resume_parked(plan, projected, tokens_left)
            if not self.parked:
                self._admit_waiting(plan, projected, tokens_left)
        return plan

    def complete_step(self, plan: StepPlan) -> None:
        """The forward ran: the scheduled tokens are in the cache."""
        for seq, n in plan.scheduled:
            seq.num_computed_tokens += n

    def _projected_usage(self, projected: dict[int, int], extra: Sequence | None = None,
                         extra_tokens: int = 0) -> dict[Level, int]:
        loads = [s.load(projected.get(s.seq_id)) for s in self.running if s is not extra]
        if extra is not None:
            loads.append(extra.load(extra_tokens))
        return self.budget.usage(loads + [s.load(on_device=False) for s in self.parked if s is not extra])

    def _reserve(self, seq: Sequence, n: int, watermark: bool) -> dict[Level, int]:
        """Blocks to keep free beyond the projected usage when `seq` runs n tokens this step.

        A commit writes its new blocks (an L0 and an L1 copy each) before placement moves the sequence's aged blocks
        down, so for a moment a level holds up to that many blocks more. Were the level full, the cache would make
        room by demoting *another* sequence's block early; the reserve keeps that from happening (a lone sequence
        only ever displaces its own blocks, so it needs none in L0). Admissions also keep a watermark free so a
        newcomer does not force a preemption on the next step.
        """
        reserve = self.budget.watermark() if watermark else {}
        new_blocks = (seq.num_computed_tokens % self.budget.block_size + n) // self.budget.block_size
        transient = max(self._step_new_blocks, new_blocks)
        others_on_device = any(s is not seq for s in self.running)
        for level in self.budget.capacity_blocks:
            if (level == Level.DEVICE and others_on_device) or (level == Level.HOST and self.budget.cold_zone_enabled):
                reserve[level] = reserve.get(level, 0) + transient
        return reserve

    def _make_room(self, seq: Sequence, n: int, projected: dict[int, int], plan: StepPlan) -> bool:
        """Preempt from the back until the running batch with `seq` extended by n tokens fits; False if `seq` went."""
        while True:
            usage = self._projected_usage({**projected, seq.seq_id: seq.num_computed_tokens + n})
            level = self.budget.overflow(usage, self._reserve(seq, n, watermark=False))
            if level is None:
                return True
            victim = self.policy.victim(self.running, self.parked, level)
            self._preempt(victim, level, plan)
            if victim is seq:
                return False

    def _preempt(self, victim: Sequence, level: Level, plan: StepPlan) -> None:
        victim.num_preemptions += 1
        if victim.status == SequenceStatus.RUNNING and level == Level.DEVICE:
            self.running.remove(victim)
            victim.status = SequenceStatus.PARKED
            self.parked.append(victim)
            plan.demoted.append(victim)
            self.num_preemptions["demote"] += 1
            return
        (self.parked if victim.status == SequenceStatus.PARKED else self.running).remove(victim)
        if victim in plan.demoted:  # parked earlier in this very step: freeing it is enough
            plan.demoted.remove(victim)
        victim.status = SequenceStatus.WAITING
        victim.num_computed_tokens = 0
        self.waiting.appendleft(victim)
        plan.recomputed.append(victim)
        self.num_preemptions["recompute"] += 1

    def _resume_parked(self, plan: StepPlan, projected: dict[int, int], tokens_left: int) -> int:
        while self.parked and tokens_left > 0:
            seq = self.parked[0]
            n = min(seq.num_pending_tokens, tokens_left)
            usage = self._projected_usage(projected, seq, seq.num_computed_tokens + n)
            alone = not self.running
            if self.budget.overflow(usage, self._reserve(seq, n, watermark=not alone)) is not None:
                break  # in order: a younger parked sequence must not overtake an older one
            self.parked.pop(0)
            self._start(seq, n, projected, plan)
            plan.promoted.append(seq)
            tokens_left -= n
        return tokens_left

    def _admit_waiting(self, plan: StepPlan, projected: dict[int, int], tokens_left: int) -> None:
        while self.waiting and tokens_left > 0:
            if len(self.running) + len(self.parked) >= self.budget.max_num_seqs:
                break  # no filling-block row for another sequence
            seq = self.policy.next_waiting(self.waiting)
            # Tokens whose KV the prefix cache already holds are not computed again (the cache attaches them).
            cached = 0 if seq.skip_prefix_reuse else \
                self.budget.cached_prefix_tokens(seq.token_ids(0, seq.num_tokens))
            n = min(seq.num_tokens - cached, tokens_left)
            usage = self._projected_usage(projected, seq, cached + n)
            alone = not self.running and not self.parked  # the watermark must not starve a lone request
            if self.budget.overflow(usage, self._reserve(seq, n, watermark=not alone)) is not None:
                break
            self.waiting.remove(seq)
            seq.num_computed_tokens = seq.num_cached_prefix_tokens = cached
            self._start(seq, n, projected, plan)
            plan.admitted.append(seq)
            tokens_left -= n

    def _start(self, seq: Sequence, n: int, projected: dict[int, int], plan: StepPlan) -> None:
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self._schedule(seq, n, projected, plan)

    def _schedule(self, seq: Sequence, n: int, projected: dict[int, int], plan: StepPlan) -> None:
        projected[seq.seq_id] = seq.num_computed_tokens + n
        plan.scheduled.append((seq, n))
        new_blocks = (seq.num_computed_tokens % self.budget.block_size + n) // self.budget.block_size
        self._step_new_blocks = max(self._step_new_blocks, new_blocks)
