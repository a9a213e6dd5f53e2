"""budget_controller=True in the engine: a simulated utilization signal and a fake clock move the L0 budget while
sequences generate; the scheduler checks steps against the new capacity, no sequence is dropped and the answers of
an exact configuration do not change."""

from __future__ import annotations

import pytest

from flashmemory import FlashMemoryEngine
from flashmemory.errors import ConfigError
from flashmemory.kvcache.manager.blocks import Level

EXACT = dict(kv_precision="fp16", selection="exact", block_size=8, active_window=16, warm_tokens=16,
             prefill_chunk_tokens=24, cpu_memory_gb=0.01, cold_zone_gb=0.01, max_num_seqs=3)
PROMPTS = [list(range(3 + i, 60 + i)) for i in range(3)]


class SteppingClock:
    """A fake clock that moves `step_s` every time it is read (each engine step reads it a few times)."""

    def __init__(self, step_s: float) -> None:
        self.now, self.step_s = 0.0, step_s

    def __call__(self) -> float:
        self.now += self.step_s
        return self.now


def test_a_quiet_device_lowers_the_budget_while_generating_and_no_answer_changes(tiny_llama):
    reference = FlashMemoryEngine(model_path=str(tiny_llama), **EXACT)
    expected = reference.generate_token_ids(PROMPTS, max_new_tokens=40, ignore_eos=True)
    reference.close()

    engine = FlashMemoryEngine(model_path=str(tiny_llama), budget_controller=True, budget_controller_min_fraction=0.05,
                               **EXACT)
    controller = engine.budget_controller
    assert controller is not None and controller.source_name == "engine thread busy fraction"
    full = controller.actuator.full_slots
    controller.drive(lambda start, end: 0.1, SteppingClock(1.0))  # simulated: a device idling at 10 %
    controller.rules = type(controller.rules)(low_hold_s=3.0, cooldown_s=1.0, min_fraction=0.05)
    got = engine.generate_token_ids(PROMPTS, max_new_tokens=40, ignore_eos=True)
    assert got == expected  # every sequence finished, with the same tokens
    downs = [d for d in controller.decisions if d.direction == "down"]
    assert downs and controller.actuator.limit_slots < full
    assert engine.core.scheduler.budget.capacity_blocks[Level.DEVICE] == controller.actuator.limit_slots
    stats = engine.stats()
    assert stats["L0_budget_bytes"] == controller.actuator.limit_slots * controller.actuator.slot_bytes
    assert stats["budget_adjustments_down"] == len(downs) and stats["L0_read_share"] > 0
    # the device memory went down with the budget (whole segments of the arena given back)
    assert stats["L0_bytes_allocated"] < full * controller.actuator.slot_bytes
    assert downs[-1].to_allocated_bytes == stats["L0_bytes_allocated"] < downs[0].from_allocated_bytes
    engine.close()


def test_a_busy_device_with_l0_misses_raises_the_budget_back(tiny_llama):
    engine = FlashMemoryEngine(model_path=str(tiny_llama), budget_controller=True, **EXACT)
    controller = engine.budget_controller
    controller.actuator.resize(controller.floor_slots)
    engine._refresh_capacity()
    controller.drive(lambda start, end: 0.95, SteppingClock(1.0))
    controller.rules = type(controller.rules)(high_hold_s=2.0, cooldown_s=1.0)
    engine.generate_token_ids(PROMPTS, max_new_tokens=40, ignore_eos=True)  # L1/L2 reads: L0 serves < 95 %
    assert any(d.direction == "up" for d in controller.decisions)
    assert controller.actuator.limit_slots > controller.floor_slots
    engine.close()


def test_a_window_served_from_the_fp16_rows_is_an_l0_hit_and_does_not_grow_the_budget(tiny_llama):
    # The default row of 128 FP16 tokens covers a 128-token window: every decode read comes from device memory,
    # none through an INT4 L0 copy. Counted as L0 reads, a busy device has no reason to grow L0.
    engine = FlashMemoryEngine(model_path=str(tiny_llama), budget_controller=True, block_size=8, active_window=128,
                               recent_fp16_tokens=128, max_num_seqs=3)
    controller = engine.budget_controller
    controller.actuator.resize(controller.floor_slots)
    engine._refresh_capacity()
    controller.drive(lambda start, end: 0.95, SteppingClock(1.0))
    controller.rules = type(controller.rules)(high_hold_s=2.0, cooldown_s=1.0)
    engine.generate_token_ids([p[:40] for p in PROMPTS], max_new_tokens=30, ignore_eos=True)
    assert engine.stats()["L0_read_share"] == 1.0
    assert not any(d.direction == "up" for d in controller.decisions)
    engine.close()


def test_the_budget_controller_needs_the_tiered_cache(tiny_llama):
    with pytest.raises(ConfigError, match="budget_controller=True moves the tiered cache's L0 budget"):
        FlashMemoryEngine(model_path=str(tiny_llama), kv_cache="contiguous", budget_controller=True)


def test_it_is_off_by_default_and_a_flag_and_a_variable(tiny_llama):
    from flashmemory.cli import build_parser
    from flashmemory.config_args import engine_kwargs

    engine = FlashMemoryEngine(model_path=str(tiny_llama), **EXACT)
    assert engine.budget_controller is None and "L0_budget_bytes" not in engine.stats()
    engine.close()
    args = build_parser().parse_args(["generate", "--budget-controller", "--budget-controller-min-fraction", "0.6"])
    assert engine_kwargs(args) == {"budget_controller": True, "budget_controller_min_fraction": 0.6}
