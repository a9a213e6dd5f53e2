"""`flashmemory diagnose`: the memory pathway of a measured run on the tiny model — every stage, pool, route and
phase reported, the timers gone afterwards, advice that names a setting and, applied, improves its figure."""

from __future__ import annotations

import json

import pytest

from flashmemory import FlashMemoryEngine
from flashmemory.cli import main
from flashmemory.config import EngineConfig
from flashmemory.settings import field_names
from flashmemory.tools.diagnose import diagnose
from flashmemory.tools.diagnose.pools import layout
from flashmemory.tools.diagnose.seed_actions import SEED_ACTIONS
from flashmemory.tools.diagnose.timers import PHASES
from flashmemory.tools.diagnose.workload import prompt_ids

# A 16-token window: the default row of 128 FP16 tokens would cover all of it (L0's INT4 copies never read, and
# INT4 would save nothing), so the row is off here.
LEVELS = dict(block_size=8, active_window=16, warm_tokens=16, prefill_chunk_tokens=32, cpu_memory_gb=0.01,
              cold_zone_gb=0.01, max_num_seqs=2, recent_fp16_tokens=0)


def _engine(tiny_llama, tmp_path, **knobs) -> FlashMemoryEngine:
    return FlashMemoryEngine(model_path=str(tiny_llama), cold_zone_dir=str(tmp_path), **{**LEVELS, **knobs})


def _advice(report, setting: str):
    return next((a for a in report.advice if setting in a.change), None)


def test_the_report_covers_every_stage_pool_route_and_phase(tiny_llama, tmp_path):
    engine = _engine(tiny_llama, tmp_path)
    ids = prompt_ids(engine, 90)
    report = diagnose(engine, ids, decode_tokens=8, disk_seconds=0.05)
    names = [s.name for s in report.stages]
    assert names[:2] == ["weights", "activation workspace"] and names[-1] == "gradients"
    assert any(n.startswith("KV L0") for n in names) and any(n.startswith("KV L2") for n in names)
    assert [p.level for p in report.pools.values()] == ["L0 device", "L1 host", "L2 disk"]
    l2 = report.pools["L2 disk"]
    assert l2.used_slots > 0 and l2.used_bytes == report.figures["l2_used_mib"] * 2**20
    assert report.traffic["prefill"]["L1->L2"]["bytes"] > 0 and report.traffic["decode"]
    assert report.traffic["attention_reads_per_decode_step"]["L2"]["blocks_per_step"] > 0
    assert set(report.time) == {"prefill", "decode"} and report.time["decode"].steps == 7
    for t in report.time.values():
        assert sum(t.phases_ms.values()) == pytest.approx(t.ms_per_step, rel=1e-6)  # the phases add up
    parts = report.time["decode"].parts_ms
    assert {"linear", "embedding", "lm_head", "attend", "choose", "l2_read"} <= set(parts)
    assert report.bandwidth["summary"] == "n/a: no GPU"
    assert report.disk["random_iops_parallel"] > 0
    assert 0 < report.selection["L0_read_share"] < 1 and "L2_selected_fraction" in report.selection
    # The filling block, read from its FP16 row: one block of 2 KV heads in 2 layers, K and V of 8 x 16 halves.
    rows = report.traffic["attention_reads_per_decode_step"]["L0 rows"]
    assert rows["blocks_per_step"] == 4 and rows["bytes_per_step"] == 4 * 2 * 8 * 16 * 2
    engine.close()


def test_block_format_weights_are_timed_as_weights_and_the_phases_add_up(tiny_llama, tmp_path):
    # weights_dtype="q8_0" keeps the projections in GGUF blocks (QuantizedLinear, as the default model's are):
    # they are not nn.Linear, and were once left to "overhead".
    from flashmemory.model.linear import QuantizedLinear

    engine = _engine(tiny_llama, tmp_path, weights_dtype="q8_0")
    assert isinstance(engine.model.layers[0].self_attn.qkv_proj, QuantizedLinear)
    report = diagnose(engine, prompt_ids(engine, 60), decode_tokens=6, disk_seconds=0)
    for t in report.time.values():
        assert t.parts_ms["linear"] > 0 and t.phases_ms["weights"] >= t.parts_ms["linear"]
        assert sum(t.phases_ms.values()) == pytest.approx(t.ms_per_step, rel=1e-6)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in engine.model.modules())
    engine.close()


def test_the_timers_are_gone_after_the_run_and_answers_do_not_change(tiny_llama, tmp_path):
    # Without the prefix cache: a reused prefix changes the prefill's float rounding, which flips this random
    # model's near-tied tokens (test_prefix_reuse.py covers reuse); this test is about the timers.
    engine = _engine(tiny_llama, tmp_path, prefix_caching=False)
    ids = prompt_ids(engine, 60)
    before = engine.generate_token_ids(ids, max_new_tokens=6, ignore_eos=True)
    report = diagnose(engine, ids, decode_tokens=6, disk_seconds=0)
    assert "forward" not in vars(engine.model) and "attend" not in vars(engine.cache)
    assert "choose_batch" not in vars(engine.cache.reader)
    assert "free_sequence" not in vars(engine.cache)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in engine.model.modules())
    assert engine.cache.attention.name in ("native", "torch") and not hasattr(engine.cache.attention, "reads")
    assert engine.generate_token_ids(ids, max_new_tokens=6, ignore_eos=True) == before
    assert report.disk["summary"].startswith("not measured")
    engine.close()


def test_pool_layout_counts_free_runs_and_holes():
    p = layout("L0 device", 10, {0, 2, 3, 7}, 100, 800)
    assert (p.free_runs, p.largest_free_run, p.holes) == (3, 3, 4)  # free: [1], [4, 5, 6], [8, 9]
    assert p.hole_share == 0.4 and p.used_bytes == 400 and p.committed_unused_bytes == 400
    empty = layout("L1 host", 4, set(), 10, 0)
    assert (empty.free_runs, empty.largest_free_run, empty.holes) == (1, 4, 0)


def test_an_l2_heavy_configuration_is_told_to_keep_its_context_in_l1_and_that_removes_the_l2_reads(tiny_llama,
                                                                                                 tmp_path):
    engine = _engine(tiny_llama, tmp_path, cpu_memory_gb=0.05)
    ids = prompt_ids(engine, 120)
    report = diagnose(engine, ids, decode_tokens=8, disk_seconds=0)
    advice = _advice(report, "warm_tokens")
    assert advice is not None and advice.figure == "decode_l2_read_share"
    assert report.figures["decode_l2_read_ms"] > 0 and "L2 holds" in advice.finding
    engine.reconfigure_kv(**{**LEVELS, "cold_zone_dir": str(tmp_path), "cpu_memory_gb": 0.05, **advice.change})
    after = diagnose(engine, ids, decode_tokens=8, disk_seconds=0)
    assert after.figures["decode_l2_read_share"] == 0 < report.figures["decode_l2_read_share"]
    assert _advice(after, "warm_tokens") is None
    engine.close()


def test_a_window_the_sequence_never_reaches_is_advised_down_and_that_saves_device_memory(tiny_llama, tmp_path):
    engine = _engine(tiny_llama, tmp_path, active_window=128, warm_tokens=64)
    ids = prompt_ids(engine, 40)
    report = diagnose(engine, ids, decode_tokens=6, disk_seconds=0)
    advice = _advice(report, "active_window")
    assert advice is not None and advice.change["active_window"] == 64 and advice.figure == "l0_capacity_mib"
    assert advice.finding.startswith("the window never fills: the longest sequence had 46 tokens")
    engine.reconfigure_kv(**{**LEVELS, "cold_zone_dir": str(tmp_path), "warm_tokens": 64, **advice.change})
    after = diagnose(engine, ids, decode_tokens=6, disk_seconds=0)
    assert after.figures["l0_capacity_mib"] < report.figures["l0_capacity_mib"]
    engine.close()


def test_mis_set_switches_are_each_advised_back(tiny_llama, tmp_path):
    engine = _engine(tiny_llama, tmp_path, selection="exact", cold_zone_uncached_reads=True, kv_precision="fp16",
                     attention_backend="torch")
    report = diagnose(engine, prompt_ids(engine, 100), decode_tokens=6, disk_seconds=0)
    assert _advice(report, "selection").change == {"selection": "quest"}
    assert _advice(report, "kv_precision").change == {"kv_precision": "mixed"}
    uncached = _advice(report, "cold_zone_uncached_reads")
    assert uncached.flags == "(leave out --cold-zone-uncached-reads)"
    from flashmemory.kvcache import native

    assert (_advice(report, "attention_backend") is not None) == (native.library() is not None)
    assert all(a.finding in report.warnings for a in report.advice)
    engine.close()


def test_the_cli_writes_json_and_a_chart(tiny_llama, tmp_path, capsys):
    chart = tmp_path / "d.png"
    rc = main(["diagnose", str(tiny_llama), "--length", "70", "--decode-tokens", "4", "--json", "--advise",
               "--chart", str(chart), "--disk-seconds", "0", "--cold-zone-dir", str(tmp_path), *[
                   a for k, v in LEVELS.items() for a in (f"--{k.replace('_', '-')}", str(v))]])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["schema"] == "flashmemory-diagnose/1" and report["workload"]["prompt_tokens"] == 70
    assert set(report["time"]["decode"]["phases_ms"]) == set(PHASES)
    assert len(report["seed_actions"]) == 12 and "advice" in report
    assert chart.stat().st_size > 10_000


def test_the_text_report_names_each_section(tiny_llama, tmp_path, capsys):
    rc = main(["diagnose", "--model", str(tiny_llama), "--length", "50", "--decode-tokens", "3", "--advise",
               "--disk-seconds", "0", "--cold-zone-dir", str(tmp_path), "--block-size", "8", "--active-window", "16"])
    out = capsys.readouterr().out
    assert rc == 0
    for heading in ("Where the bytes live", "KV pools", "Traffic between levels", "Selection and prefetch",
                    "Time per step", "Advice", "Seed 004's twelve tuning actions here"):
        assert heading in out


def test_diagnose_runs_on_the_contiguous_cache_too(tiny_llama, tmp_path):
    engine = FlashMemoryEngine(model_path=str(tiny_llama), kv_cache="contiguous")
    report = diagnose(engine, prompt_ids(engine, 40), decode_tokens=4, disk_seconds=0)
    assert report.pools == {} and any(s.name == "KV (contiguous)" for s in report.stages)
    assert report.time["decode"].parts_ms["attend"] > 0
    engine.close()


def test_the_seed_actions_are_the_twelve_and_name_real_settings():
    assert [a.number for a in SEED_ACTIONS] == list(range(1, 13))
    names = set(field_names(EngineConfig))
    for action in SEED_ACTIONS:
        assert set(action.settings) <= names, action
        assert bool(action.settings) != action.here.startswith("does not apply"), action


def test_a_bad_decode_count_is_a_clear_error(tiny_llama, capsys):
    assert main(["diagnose", str(tiny_llama), "--decode-tokens", "1"]) == 1
    assert "at least 2" in capsys.readouterr().err
