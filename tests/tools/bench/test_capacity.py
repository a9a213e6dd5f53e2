"""Longest context under a fixed device-KV budget, from the bytes each engine was measured holding."""

from __future__ import annotations

import pytest

from flashmemory.tools.bench.capacity import LimitCheck, linear_fit, longest_contexts
from flashmemory.tools.bench.engines import select_engines
from flashmemory.tools.bench.summary import EngineRow

MIB = 2**20
FP32_PER_TOKEN = 46080  # SmolLM2: 2 x 30 layers x 3 heads x 64 x 4 bytes
BUDGET = 45 * MIB  # an FP16 cache of 2048 tokens
LIMIT = 8192


def row(engine: str, prompt: int, device: float, used: float | None = None, host: float = 0.0,
        status: str = "ok", reason: str = "") -> EngineRow:
    family = "flashmemory" if engine.startswith("fm-") else "transformers"
    return EngineRow(engine, family, prompt, prompt, status, reason=reason, num_generated_tokens=16,
                     device_kv_bytes=device, device_kv_bytes_used=device if used is None else used,
                     host_kv_bytes=host)


def test_linear_fit_recovers_a_layout_and_a_single_point_goes_through_the_origin():
    fixed, per_token = linear_fit([(100.0, 5000.0 + 100 * 7), (1000.0, 5000.0 + 1000 * 7), (400.0, 5000 + 400 * 7)])
    assert fixed == pytest.approx(5000) and per_token == pytest.approx(7)
    assert linear_fit([(64.0, 640.0)]) == (0.0, 10.0)


def test_a_growing_cache_stops_where_its_bytes_reach_the_budget():
    specs = select_engines(["hf-dynamic"])
    # Tokens held as the request ended: prompt + 16 generated - 1 (the last one is never fed back).
    rows = [row("hf-dynamic", n - 15, n * FP32_PER_TOKEN) for n in (528, 2064, 8192)]
    (cap,) = longest_contexts(specs, rows, {}, BUDGET, LIMIT, "float32", None)
    assert cap.bytes_per_token == pytest.approx(FP32_PER_TOKEN)
    assert cap.longest_tokens == 1024 and not cap.reaches_limit
    assert "45.00 KiB per token" in cap.why and "holds 1024 tokens" in cap.why


def test_flashmemory_exact_cache_is_judged_by_its_layout_not_its_doubling_buffer():
    specs = select_engines(["fm-exact"])
    # 528 tokens in a 1024-token buffer: allocated bytes are twice the tokens' bytes.
    rows = [row("fm-exact", 512, 1024 * 23040, used=527 * 23040), row("fm-exact", 2048, 4096 * 23040,
                                                                        used=2063 * 23040)]
    (cap,) = longest_contexts(specs, rows, {}, BUDGET, LIMIT, "float32", None)
    assert cap.bytes_per_token == pytest.approx(23040) and cap.longest_tokens == 2048


def test_a_fixed_l0_arena_reaches_the_model_limit_and_the_limit_run_is_cited():
    specs = select_engines(["fm-mixed", "fm-mixed-budget"])
    arena = 16 * MIB
    rows = [row("fm-mixed", n, arena, host=n * 23040) for n in (512, 2048, 8175)]
    rows += [row("fm-mixed-budget", n, b) for n, b in ((512, 2.5 * MIB), (8175, 44.5 * MIB))]
    check = LimitCheck("fm-mixed-budget", 8175, BUDGET, int(44.5 * MIB), 3.0)
    mixed, budget = longest_contexts(specs, rows, {}, BUDGET, LIMIT, "float32", check)
    assert mixed.longest_tokens == LIMIT and mixed.reaches_limit and mixed.bytes_per_token == 0
    assert mixed.verified == "ran 8175 tokens with 16.0 MiB on the device"
    assert budget.longest_tokens == LIMIT and "ran 8175 tokens under 45.0 MiB: 44.5 MiB" in budget.verified


def test_a_failed_limit_run_is_not_reported_as_reaching_the_limit():
    specs = select_engines(["fm-mixed-budget"])
    rows = [row("fm-mixed-budget", 512, 2.5 * MIB)]
    check = LimitCheck("fm-mixed-budget", 8175, BUDGET, None, None, error="worker killed by SIGKILL")
    (cap,) = longest_contexts(specs, rows, {}, BUDGET, LIMIT, "float32", check)
    assert not cap.reaches_limit and cap.longest_tokens is None and "SIGKILL" in cap.verified


def test_an_arena_larger_than_the_budget_says_so():
    specs = select_engines(["fm-mixed"])
    rows = [row("fm-mixed", 2048, 60 * MIB)]
    (cap,) = longest_contexts(specs, rows, {}, BUDGET, LIMIT, "float32", None)
    assert cap.longest_tokens == 0 and not cap.reaches_limit and "more than the budget" in cap.why


def test_unavailable_and_failed_engines_keep_their_reason():
    specs = select_engines(["hf-offloaded", "hf-static"])
    rows = [row("hf-static", 8175, 0, status="n/a", reason="n/a: worker killed by SIGKILL (out of memory?)")]
    caps = longest_contexts(specs, rows, {"hf-offloaded": "n/a: needs CUDA"}, BUDGET, LIMIT, "float32", None)
    offloaded, static = (next(c for c in caps if c.engine == name) for name in ("hf-offloaded", "hf-static"))
    assert offloaded.why == "n/a: needs CUDA" and offloaded.longest_tokens is None
    assert "SIGKILL" in static.why and static.longest_tokens is None


def test_an_engine_that_failed_at_a_length_does_not_reach_the_limit_on_paper():
    specs = select_engines(["hf-quanto-int2"])
    rows = [row("hf-quanto-int2", 512, 3 * MIB), row("hf-quanto-int2", 2048, 9 * MIB),
            row("hf-quanto-int2", 8175, 0, status="n/a", reason="n/a: RuntimeError")]
    (cap,) = longest_contexts(specs, rows, {}, BUDGET, LIMIT, "float32", None)
    assert cap.longest_tokens == LIMIT and not cap.reaches_limit
    assert "did not run at 8175 tokens" in cap.why
