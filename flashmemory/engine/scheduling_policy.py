"""SchedulingPolicy: the scheduler's two choices that are a matter of policy — which waiting sequence is admitted
next, and which resident sequence is preempted when a KV level would overflow. A new policy (priorities, fairness
between clients) is one class here plus one registry line; the scheduler's memory accounting stays as it is."""

from __future__ import annotations

from collections import deque
from typing import Protocol

from flashmemory.engine.sequence import Sequence
from flashmemory.kvcache.manager.blocks import Level


class SchedulingPolicy(Protocol):
    """Orders admission and preemption."""

    name: str

    def next_waiting(self, waiting: deque[Sequence]) -> Sequence:
        """The waiting sequence to admit next (the queue is not empty). Preempted sequences sit at its front."""

    def victim(self, running: list[Sequence], parked: list[Sequence], level: Level) -> Sequence:
        """The sequence to preempt when `level` would overflow. `running` is in admission order, `parked` in
        preemption order; a parked victim (not on the device) is only useful when the level is not L0."""


class FirstComeFirstServed:
    """Admit in arrival order; preempt the most recently admitted (a parked one first when L0 is not the issue)."""

    name = "fcfs"

    def next_waiting(self, waiting: deque[Sequence]) -> Sequence:
        return waiting[0]

    def victim(self, running: list[Sequence], parked: list[Sequence], level: Level) -> Sequence:
        return parked[-1] if level != Level.DEVICE and parked else running[-1]


FCFS = FirstComeFirstServed()
POLICIES: dict[str, SchedulingPolicy] = {FCFS.name: FCFS}
