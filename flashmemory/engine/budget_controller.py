"""BudgetController: the DynamicBudgetController of seed 000 §5.2 — moves the L0 KV budget at run time within
max_gpu_memory_mb by the device's utilization (no torch).

Every `sample_interval_s` it reads the utilization of the last interval (NVML's on a GPU; on a CPU host the
engine thread's busy fraction, from the steps timed through `busy()`), then:

- below `low_utilization` (30 %) for `low_hold_s` (30 s): the budget goes down by `shrink_fraction` (10 %);
- above `high_utilization` (85 %) for `high_hold_s` (10 s), with L0 serving fewer than `target_l0_hit_rate`
  (95 %) of the blocks decode steps read over that time (device reads: L0 copies and the FP16 rows of the
  newest tokens): it goes up by `grow_fraction` (5 %), and the hottest blocks that lost their L0 copy are
  promoted back.

Hysteresis: the dead band between the two thresholds, the hold times (a condition must hold the whole time, and
starts over after every adjustment) and a cooldown after each adjustment. Bounds: never above the L0 pool
preallocated at start-up (max_gpu_memory_mb's share), never below `min_fraction` of it nor below one sequence's
window. Shrinking demotes blocks and gives the freed segments of device memory back (a co-located service can
take them); growing takes them again and promotes blocks (kvcache/device_budget.py); no sequence is dropped —
when fewer sequences fit, the scheduler preempts by demotion and resumes them later. Decisions are logged, kept
in `decisions` and exported as metrics (`flashmemory:kv_budget_bytes{tier="L0"}`,
`flashmemory:kv_budget_adjustments_total{direction}`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

logger = logging.getLogger(__name__)

MIB = 2**20


@dataclass(frozen=True)
class BudgetRules:
    """Thresholds, hold times, step sizes and bounds of the controller (seed 000 §5.2's values by default)."""

    low_utilization: float = 0.30  # below this for low_hold_s: shrink
    low_hold_s: float = 30.0
    shrink_fraction: float = 0.10  # of the budget in effect
    high_utilization: float = 0.85  # above this for high_hold_s, with a low L0 hit rate: grow
    high_hold_s: float = 10.0
    grow_fraction: float = 0.05
    target_l0_hit_rate: float = 0.95  # share of decode block reads served from L0 below which growing helps
    min_fraction: float = 0.5  # lowest budget, as a fraction of the L0 pool
    cooldown_s: float = 10.0  # no adjustment this soon after the previous one
    sample_interval_s: float = 1.0  # utilization is read over intervals this long


class BudgetActuator(Protocol):
    """What the controller moves: the L0 limit (kvcache/device_budget.py's DeviceBudget)."""

    full_slots: int  # the L0 pool preallocated at start-up
    limit_slots: int  # slots in use now
    min_slots: int  # fewest slots one sequence needs
    slot_bytes: int
    allocated_bytes: int  # device bytes L0's storage holds now

    def resize(self, num_slots: int):  # -> ResizeResult (limit_slots, relocated, demoted, promoted, ...)
        ...

    def read_counts(self) -> tuple[int, int]:
        """(blocks decode steps read from device memory, blocks they read from every level), cumulative."""


UtilizationSource = Callable[[float, float], "float | None"]  # (interval start, end) -> fraction busy, or None


@dataclass(frozen=True)
class BudgetDecision:
    """One adjustment of the L0 budget."""

    at_s: float  # the controller's clock
    direction: str  # "down" or "up"
    from_slots: int
    to_slots: int
    slot_bytes: int
    utilization: float  # of the interval that triggered it
    held_s: float  # how long the condition had held
    l0_hit_rate: float | None  # over that time (growing only)
    demoted: int
    promoted: int
    from_allocated_bytes: int  # device bytes L0's storage held before and after
    to_allocated_bytes: int

    def describe(self) -> str:
        hit = f", L0 served {self.l0_hit_rate:.0%} of reads" if self.l0_hit_rate is not None else ""
        return (f"L0 budget {self.direction}: {self.from_slots} -> {self.to_slots} slots "
                f"({self.from_slots * self.slot_bytes / MIB:.1f} -> {self.to_slots * self.slot_bytes / MIB:.1f} MiB) "
                f"after {self.held_s:.0f} s at {self.utilization:.0%} utilization{hit}; "
                f"{self.demoted} blocks demoted, {self.promoted} promoted; device memory "
                f"{self.from_allocated_bytes / MIB:.1f} -> {self.to_allocated_bytes / MIB:.1f} MiB")


class BusyMeter:
    """Owns the engine thread's recent busy intervals; says which fraction of a span of time they cover."""

    def __init__(self, keep_s: float = 120.0) -> None:
        self.keep_s = keep_s
        self._intervals: deque[tuple[float, float]] = deque()

    def record(self, start: float, end: float) -> None:
        self._intervals.append((start, end))
        while self._intervals and self._intervals[0][1] < end - self.keep_s:
            self._intervals.popleft()

    def fraction(self, start: float, end: float) -> float | None:
        if end <= start:
            return None
        busy = sum(max(0.0, min(b, end) - max(a, start)) for a, b in self._intervals)
        return min(1.0, busy / (end - start))


class BudgetController:
    """Owns the utilization history, the hold timers and the decisions; moves the actuator's limit."""

    def __init__(self, actuator: BudgetActuator, rules: BudgetRules | None = None,
                 clock: Callable[[], float] = time.monotonic, utilization: UtilizationSource | None = None,
                 on_resize: Callable[[], None] | None = None, source_name: str = "engine thread busy fraction") -> None:
        self.actuator = actuator
        self.rules = rules or BudgetRules()
        self.clock = clock
        self.meter = BusyMeter()
        self.utilization = utilization or self.meter.fraction
        self.source_name = source_name  # what the utilization is ("NVML GPU utilization", ...)
        self.on_resize = on_resize  # told after every change (the engine refreshes the scheduler's capacity)
        self.decisions: list[BudgetDecision] = []
        self.last_utilization: float | None = None
        self._sampled_at = clock()
        self._low_since: float | None = None
        self._high_since: float | None = None
        self._high_reads = (0, 0)  # read counts when the high streak began
        self._cooldown_until = float("-inf")

    def drive(self, utilization: UtilizationSource | None, clock: Callable[[], float] | None = None) -> None:
        """Read the utilization from `utilization` (None: the busy fraction) on `clock` from now on, timers
        restarted (tests drive a running engine's controller with a simulated signal and a fake clock)."""
        self.utilization = utilization or self.meter.fraction
        if clock is not None:
            self.clock = clock
            self.meter = BusyMeter()
        self._sampled_at = self.clock()
        self._low_since = self._high_since = None

    @property
    def floor_slots(self) -> int:
        a = self.actuator
        return min(a.full_slots, max(a.min_slots, int(a.full_slots * self.rules.min_fraction + 0.5)))

    @contextmanager
    def busy(self) -> Iterator[None]:
        """Time a stretch of engine work (one step) for the busy fraction."""
        start = self.clock()
        try:
            yield
        finally:
            self.meter.record(start, self.clock())

    def tick(self) -> BudgetDecision | None:
        """Sample the utilization if an interval has passed and adjust the budget when a rule says so."""
        now = self.clock()
        if now - self._sampled_at < self.rules.sample_interval_s:
            return None
        start, self._sampled_at = self._sampled_at, now
        u = self.utilization(start, now)
        self.last_utilization = u
        if u is None:
            self._low_since = self._high_since = None
            return None
        self._track(u, start)
        if now < self._cooldown_until:
            return None
        r = self.rules
        if self._low_since is not None and now - self._low_since >= r.low_hold_s:
            return self._adjust("down", u, now - self._low_since, None, now)
        if self._high_since is not None and now - self._high_since >= r.high_hold_s:
            hit = self._hit_rate_since_high()
            if hit is not None and hit < r.target_l0_hit_rate:
                return self._adjust("up", u, now - self._high_since, hit, now)
        return None

    def _track(self, u: float, start: float) -> None:
        r = self.rules
        if u < r.low_utilization:
            self._low_since = start if self._low_since is None else self._low_since
        else:
            self._low_since = None
        if u > r.high_utilization:
            if self._high_since is None:
                self._high_since = start
                self._high_reads = self.actuator.read_counts()
        else:
            self._high_since = None

    def _hit_rate_since_high(self) -> float | None:
        l0, total = self.actuator.read_counts()
        l0, total = l0 - self._high_reads[0], total - self._high_reads[1]
        # No decode step read anything (or the counter restarted with a new attention backend): no evidence.
        return l0 / total if total > 0 and l0 >= 0 else None

    def _adjust(self, direction: str, u: float, held_s: float, hit: float | None, now: float) -> BudgetDecision | None:
        a, r = self.actuator, self.rules
        before, allocated_before = a.limit_slots, a.allocated_bytes
        if direction == "down":
            target = max(self.floor_slots, min(before - 1, int(before * (1 - r.shrink_fraction))))
        else:
            target = min(a.full_slots, max(before + 1, int(before * (1 + r.grow_fraction) + 0.5)))
        self._low_since = self._high_since = None  # the condition must hold anew before the next adjustment
        self._cooldown_until = now + r.cooldown_s
        if target == before or (direction == "down" and before <= self.floor_slots):
            logger.debug("L0 budget already at its %s bound (%d slots)", "lower" if direction == "down" else "upper",
                         before)
            return None
        result = a.resize(target)
        decision = BudgetDecision(now, direction, before, result.limit_slots, a.slot_bytes, u, held_s, hit,
                                  result.demoted, result.promoted, allocated_before, a.allocated_bytes)
        self.decisions.append(decision)
        logger.info(decision.describe())
        if self.on_resize is not None:
            self.on_resize()
        return decision

    def stats(self) -> dict[str, int | float]:
        """Figures for engine.stats() and the metrics: the budget in bytes and slots, adjustments by direction."""
        a = self.actuator
        l0, total = a.read_counts()
        out: dict[str, int | float] = {
            "L0_budget_bytes": a.limit_slots * a.slot_bytes, "L0_budget_slots": a.limit_slots,
            "L0_budget_max_bytes": a.full_slots * a.slot_bytes, "L0_budget_min_bytes": self.floor_slots * a.slot_bytes,
            "budget_adjustments_down": sum(d.direction == "down" for d in self.decisions),
            "budget_adjustments_up": sum(d.direction == "up" for d in self.decisions),
            "L0_read_share": l0 / total if total else 0.0,
        }
        if self.last_utilization is not None:
            out["device_utilization"] = self.last_utilization
        return out


def nvml_utilization(device_index: int) -> UtilizationSource | None:
    """The GPU's utilization from NVML (pynvml), or None where NVML cannot be read (then the busy fraction is used)."""
    try:
        import pynvml  # optional: `pip install nvidia-ml-py`
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        pynvml.nvmlDeviceGetUtilizationRates(handle)
    except Exception as e:  # noqa: BLE001 - missing module, no driver, no such device: fall back
        logger.info("NVML is not readable (%s): the budget controller uses the engine thread's busy fraction", e)
        return None

    def read(start: float, end: float) -> float | None:
        try:
            return pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0
        except Exception:  # noqa: BLE001 - a transient NVML failure skips one sample
            return None

    return read
