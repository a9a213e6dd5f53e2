"""MATS-2's engine case: EngineCore through the prefix-reuse path with a damaged cold zone."""

from __future__ import annotations

import time

from flashmemory.engine.core import EngineCore
from flashmemory.tools.mats.reuse_faults import FAULT_KINDS, run_reuse_faults


def test_reuse_faults_case_survives_every_fault_kind(tiny_llama, tmp_path):
    tally = run_reuse_faults(
        str(tiny_llama), str(tmp_path), seed=0, deadline=time.monotonic(), min_trials=3
    )
    assert tally.trials == 3 and set(tally.faults) == set(FAULT_KINDS)
    assert tally.survived == tally.faults, tally.samples
    assert (tally.engine_deaths, tally.innocent_harmed, tally.wrong_answers, tally.blocks_left) == (
        0,
        0,
        0,
        0,
    )
    assert tally.bad_blocks_dropped >= 1  # the reuse path itself met the damage


def test_reuse_faults_case_reports_a_fault_that_escapes_the_step(tiny_llama, tmp_path, monkeypatch):
    def uncontained(self, error, seq):
        raise error

    monkeypatch.setattr(EngineCore, "_contain_admission", uncontained)
    tally = run_reuse_faults(
        str(tiny_llama), str(tmp_path), seed=0, deadline=time.monotonic(), min_trials=1
    )
    assert tally.engine_deaths == 1 and not tally.survived
    assert "escaped EngineCore.step" in tally.samples[0]
