"""The DynamicBudgetController on its own (no torch): a simulated utilization signal and a fake clock drive it
against a fake L0 pool; the seed's rules, hysteresis, bounds and decisions are checked."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest

from flashmemory.engine.budget_controller import BudgetController, BudgetRules, BusyMeter


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Result:
    limit_slots: int
    relocated: int = 0
    demoted: int = 0
    promoted: int = 0


class FakePool:
    """An L0 pool of `full_slots` slots whose decode reads are set by the test (l0 share of `reads` per second)."""

    def __init__(self, full_slots: int = 100, limit_slots: int | None = None, min_slots: int = 10) -> None:
        self.full_slots = full_slots
        self.limit_slots = full_slots if limit_slots is None else limit_slots
        self.min_slots = min_slots
        self.slot_bytes = 2**20
        self.l0_reads = self.total_reads = 0
        self.resizes: list[int] = []

    @property
    def allocated_bytes(self) -> int:
        return self.limit_slots * self.slot_bytes

    def resize(self, num_slots: int) -> Result:
        self.resizes.append(num_slots)
        demoted = max(0, self.limit_slots - num_slots)
        promoted = max(0, num_slots - self.limit_slots)
        self.limit_slots = num_slots
        return Result(num_slots, demoted=demoted, promoted=promoted)

    def read_counts(self) -> tuple[int, int]:
        return self.l0_reads, self.total_reads

    def decode(self, l0_share: float, reads: int = 1000) -> None:
        self.l0_reads += int(reads * l0_share)
        self.total_reads += reads


class Signal:
    """A simulated utilization signal: the value the test sets, whatever the interval."""

    def __init__(self, value: float) -> None:
        self.value: float | None = value

    def __call__(self, start: float, end: float) -> float | None:
        return self.value


def run(controller: BudgetController, clock: FakeClock, seconds: int, pool: FakePool | None = None,
        l0_share: float = 1.0) -> list:
    """Advance the clock one second at a time for `seconds`, ticking; the decisions made."""
    made = []
    for _ in range(seconds):
        clock.now += 1.0
        if pool is not None:
            pool.decode(l0_share)
        decision = controller.tick()
        if decision is not None:
            made.append(decision)
    return made


def make(value: float, **pool_args) -> tuple[BudgetController, FakePool, FakeClock, Signal]:
    clock, pool, signal = FakeClock(), FakePool(**pool_args), Signal(value)
    return BudgetController(pool, BudgetRules(), clock=clock, utilization=signal), pool, clock, signal


def test_under_30_percent_for_30_seconds_lowers_the_budget_by_10_percent():
    controller, pool, clock, _ = make(0.10)
    assert run(controller, clock, 29) == []  # 29 s: not yet
    [decision] = run(controller, clock, 1)
    assert (decision.direction, decision.from_slots, decision.to_slots) == ("down", 100, 90)
    assert pool.limit_slots == 90 and decision.held_s == pytest.approx(30)


def test_one_busy_interval_restarts_the_low_timer():
    controller, pool, clock, signal = make(0.10)
    run(controller, clock, 20)
    signal.value = 0.50  # in the dead band
    run(controller, clock, 1)
    signal.value = 0.10
    assert run(controller, clock, 29) == []  # 29 s of low since the interruption
    assert len(run(controller, clock, 1)) == 1


def test_over_85_percent_for_10_seconds_with_a_low_l0_hit_rate_raises_it_by_5_percent():
    controller, pool, clock, _ = make(0.95, limit_slots=80)
    assert run(controller, clock, 9, pool, l0_share=0.60) == []
    [decision] = run(controller, clock, 1, pool, l0_share=0.60)
    assert (decision.direction, decision.from_slots, decision.to_slots) == ("up", 80, 84)
    assert decision.l0_hit_rate == pytest.approx(0.60)


def test_a_busy_device_whose_reads_l0_already_serves_keeps_its_budget():
    controller, pool, clock, _ = make(0.95, limit_slots=80)
    assert run(controller, clock, 60, pool, l0_share=0.97) == []
    assert pool.resizes == []


def test_a_busy_device_that_decoded_nothing_keeps_its_budget():
    controller, pool, clock, _ = make(0.95, limit_slots=80)
    assert run(controller, clock, 60) == []  # prefill only: no evidence that L0 misses


def test_the_dead_band_between_30_and_85_percent_changes_nothing():
    controller, pool, clock, _ = make(0.60, limit_slots=80)
    assert run(controller, clock, 300, pool, l0_share=0.1) == []


def test_after_an_adjustment_the_condition_must_hold_anew_and_the_cooldown_pass():
    controller, pool, clock, _ = make(0.10)
    run(controller, clock, 30)
    assert run(controller, clock, 29) == []  # the low timer started over
    assert [d.to_slots for d in run(controller, clock, 1)] == [81]


def test_the_budget_stays_within_its_bounds():
    controller, pool, clock, signal = make(0.05, min_slots=10)
    run(controller, clock, 3600)
    assert pool.limit_slots == controller.floor_slots == 50  # min_fraction 0.5 of the pool
    assert min(pool.resizes) == 50
    signal.value = 0.99
    run(controller, clock, 3600, pool, l0_share=0.5)
    assert pool.limit_slots == 100 and max(pool.resizes) == 100  # never above the pool sized at start-up
    downs = sum(d.direction == "down" for d in controller.decisions)
    ups = sum(d.direction == "up" for d in controller.decisions)
    assert controller.stats()["budget_adjustments_down"] == downs and controller.stats()["budget_adjustments_up"] == ups


def test_the_floor_is_never_below_one_sequences_window():
    controller, pool, clock, _ = make(0.05, min_slots=70)
    run(controller, clock, 3600)
    assert pool.limit_slots == 70


def test_decisions_are_logged_and_reported(caplog):
    controller, pool, clock, _ = make(0.10)
    with caplog.at_level(logging.INFO, logger="flashmemory.engine.budget_controller"):
        run(controller, clock, 30)
    assert "L0 budget down: 100 -> 90 slots (100.0 -> 90.0 MiB) after 30 s at 10% utilization" in caplog.text
    stats = controller.stats()
    assert stats["L0_budget_bytes"] == 90 * 2**20 and stats["L0_budget_slots"] == 90
    assert stats["device_utilization"] == pytest.approx(0.10)


def test_an_unreadable_signal_skips_the_sample_and_restarts_the_timers():
    controller, pool, clock, signal = make(0.10)
    run(controller, clock, 20)
    signal.value = None  # e.g. NVML failed once
    run(controller, clock, 1)
    signal.value = 0.10
    assert run(controller, clock, 29) == []


def test_resizes_are_told_to_whoever_keeps_capacity():
    told = []
    clock, pool = FakeClock(), FakePool()
    controller = BudgetController(pool, clock=clock, utilization=Signal(0.1), on_resize=lambda: told.append(1))
    run(controller, clock, 30)
    assert told == [1]


# ---- the busy fraction (a CPU host's utilization) ----------------------------------------------------------------

def test_the_busy_fraction_comes_from_the_steps_timed():
    clock, pool = FakeClock(), FakePool()
    controller = BudgetController(pool, clock=clock)  # no signal: the engine thread's busy fraction
    for _ in range(40):  # each second: a 0.2 s step, then 0.8 s idle
        with controller.busy():
            clock.now += 0.2
        clock.now += 0.8
        controller.tick()
    assert controller.last_utilization == pytest.approx(0.2)
    assert pool.limit_slots == 90  # 20 % < 30 % for 30 s


def test_busy_meter_counts_only_the_overlap_with_the_span():
    meter = BusyMeter()
    meter.record(0.0, 1.0)
    meter.record(2.0, 2.5)
    assert meter.fraction(0.5, 2.5) == pytest.approx(0.5)
    assert meter.fraction(3.0, 3.0) is None
