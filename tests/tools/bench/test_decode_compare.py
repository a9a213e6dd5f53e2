"""`flashmemory bench --decode-only`: persistent workers answer step commands in interleaved rounds, and every
engine's decode-mode fidelity comes back with its speed."""

from __future__ import annotations

import json

import pytest

from flashmemory.tools.bench.decode_compare import DecodeEngine, named_engines, run_decode_compare, to_markdown
from flashmemory.tools.bench.kv_bytes import llama_cpp_kv_bytes


def test_persistent_workers_run_interleaved_teacher_forced_rounds(tiny_llama, tmp_path):
    ids_path = tmp_path / "ids.json"
    ids_path.write_text(json.dumps(list(range(3, 80))))
    engines = (DecodeEngine("fm", "flashmemory", {"kv_cache": "contiguous"}, "PASSIVE"),
               DecodeEngine("fm-float32", "flashmemory", {"kv_cache": "contiguous", "weights_dtype": "float32"}))
    report = run_decode_compare(tiny_llama, ids_path, [24], rounds=2, steps=3, threads=1, engines=engines,
                                work_dir=tmp_path)
    rows = report["rows"]
    assert [r["engine"] for r in rows] == ["fm", "fm-float32"]
    assert all(len(r["step_ms"]) == 6 and r["ms_per_token"] > 0 and r["peak_rss_mib"] > 0 for r in rows)
    assert all(r["vs_llamacpp"] is None for r in rows)  # no llama.cpp engine in this run
    assert all(r["fidelity"]["scored_steps"] == 6 and r["fidelity"]["against"] == [] for r in rows)  # no fm-exact
    assert rows[0]["omp_wait_policy"] == "PASSIVE" and rows[1]["omp_wait_policy"] == "default"
    table = to_markdown(report)
    assert "| 24 | fm | 1 |" in table and "1 threads per engine unless the row says; 2 interleaved rounds of 3" in table


def test_engines_start_from_a_kv_snapshot_and_prefill_only_the_last_chunk(tiny_llama, tmp_path):
    """--kv-snapshot: each worker restores the context but its last chunk, prefills that chunk, then decodes."""
    from flashmemory.engine.engine import FlashMemoryEngine

    ids = list(range(3, 80))
    ids_path = tmp_path / "ids.json"
    ids_path.write_text(json.dumps(ids))
    snapshot = tmp_path / "p.kvsnap"
    engine = FlashMemoryEngine(model_path=str(tiny_llama), kv_cache="contiguous", kv_precision="fp16")
    engine.score_tokens(ids[:40], num_teacher_forced=4, kv_snapshot=snapshot)  # 36 prompt tokens saved
    engine.close()
    chunk = {"prefill_chunk_tokens": 8}
    exact = {"kv_cache": "contiguous", "kv_precision": "fp16", **chunk}
    engines = (DecodeEngine("fm-mixed", "flashmemory", {"kv_cache": "tiered", **chunk}, "PASSIVE"),
               DecodeEngine("fm-exact", "flashmemory", exact, "PASSIVE", threads=1),
               DecodeEngine("hf-dynamic", "transformers", {"cache": "dynamic"}))
    report = run_decode_compare(tiny_llama, ids_path, [30], rounds=2, steps=2, threads=1, engines=engines,
                                work_dir=tmp_path, kv_snapshot=snapshot, restore_chunk_tokens=8)
    rows = {r["engine"]: r for r in report["rows"]}
    assert all(r["restored_tokens"] == 24 and len(r["step_ms"]) == 4 and r["peak_rss_mib"] > 0 for r in rows.values())
    # transformers from the same FP16 KV, in float32: the exact cache's distributions to float32 rounding
    (hf,) = rows["hf-dynamic"]["fidelity"]["against"]
    assert hf["reference"] == "fm-exact" and hf["mean_kl"] < 1e-4 and hf["top1"] == 1.0
    # K and V of 2 layers, 2 KV heads x 16, float32, for the context and the 4 steps fed
    assert rows["hf-dynamic"]["kv_bytes"]["device"] == 2 * 2 * 2 * 16 * 4 * (30 + 4)
    table = to_markdown(report)
    assert "| 30 | fm-exact | 1 |" in table and "from p.kvsnap" in table and "| top-1 vs fm-exact |" in table


@pytest.fixture
def fake_llama_cpp_on_path(tmp_path, monkeypatch):
    """The stand-in llama_cpp importable by the worker processes (they inherit PYTHONPATH)."""
    folder = tmp_path / "fake-site"
    folder.mkdir()
    (folder / "llama_cpp.py").write_text("from tests.tools.bench.fake_llama_cpp import *  # noqa: F401,F403\n")
    monkeypatch.setenv("PYTHONPATH", str(folder))
    return folder


def test_fidelity_is_reported_against_fm_exact_and_llama_cpp_q8_0_against_its_f16(tiny_llama, tmp_path,
                                                                                    fake_llama_cpp_on_path):
    from tests.tools.bench import fake_llama_cpp

    ids = [(i * 13 + 5) % (fake_llama_cpp.VOCAB - 3) + 3 for i in range(80)]  # in both vocabularies
    ids_path = tmp_path / "ids.json"
    ids_path.write_text(json.dumps(ids))
    engines = named_engines(["fm-exact", "fm-mixed", "llamacpp-f16", "llamacpp-q8_0-fa"], "PASSIVE")
    report = run_decode_compare(tiny_llama, ids_path, [24], rounds=2, steps=3, threads=1, engines=engines,
                                work_dir=tmp_path)
    rows = {r["engine"]: r for r in report["rows"]}
    assert all(r["fidelity"]["scored_steps"] == 6 and r["fidelity"]["decode_ppl"] > 1 for r in rows.values())
    assert rows["fm-exact"]["fidelity"]["against"] == []
    (mixed,) = rows["fm-mixed"]["fidelity"]["against"]
    assert mixed["reference"] == "fm-exact" and mixed["mean_kl"] > -1e-6 and 0 <= mixed["top1"] <= 1
    against_exact, against_f16 = rows["llamacpp-q8_0-fa"]["fidelity"]["against"]
    assert against_exact["na"] == f"vocabularies differ (320 vs {fake_llama_cpp.VOCAB} logits)"
    assert against_f16["reference"] == "llamacpp-f16" and against_f16["mean_kl"] > 1e-4
    assert rows["llamacpp-f16"]["vs_llamacpp"] == 1.0 and rows["fm-exact"]["vs_llamacpp"] > 0
    # the fake's 2 layers of 2 KV heads x 16, over the 256 cells it rounds n_ctx up to
    assert rows["llamacpp-q8_0-fa"]["kv_bytes"]["device"] == llama_cpp_kv_bytes("q8_0", "q8_0", 256, 2, 32)
    assert rows["fm-exact"]["kv_bytes"]["device"] > 0 and rows["fm-mixed"]["kv_bytes"]["host"] >= 0
    table = to_markdown(report)
    assert "vs llamacpp-f16: ΔPPL / KL / top-1" in table and "n/a: vocabularies differ" in table
    assert "against llama.cpp f16 only the KV type differs" in table


def test_an_engine_the_decode_comparison_cannot_run_is_refused_by_name():
    from flashmemory.errors import ConfigError

    with pytest.raises(ConfigError, match="does not run llamacpp-q4_0-fa"):
        named_engines(["llamacpp-q4_0-fa"], None)
    with pytest.raises(ConfigError, match="does not run hf-static"):
        named_engines(["hf-static"], None)


def test_the_budgeted_engine_runs_under_the_settings_of_the_budget_and_asks_for_one():
    from flashmemory.errors import ConfigError

    with pytest.raises(ConfigError, match="pass --budget-mb"):
        named_engines(["fm-mixed-budget"], None)
    (engine,) = named_engines(["fm-mixed-budget"], "PASSIVE", lambda base: {**base, "max_gpu_memory_mb": 700})
    assert engine.settings["max_gpu_memory_mb"] == 700 and engine.settings["kv_precision"] == "mixed"


def test_decode_only_budget_settings_hold_the_l0_arena_under_the_budget(tmp_path):
    """`bench --decode-only --budget-mb`: the knobs count the weights as the engine keeps them (a GGUF's blocks)."""
    import argparse

    from flashmemory import FlashMemoryEngine
    from flashmemory.model.loader import open_checkpoint
    from flashmemory.tools.bench.command import _kv_budget

    checkpoint = open_checkpoint(None)  # the embedded SmolLM2 GGUF
    knobs = _kv_budget(argparse.Namespace(budget_mb=8.0), checkpoint, 600)({"kv_precision": "mixed",
                                                                            "max_num_seqs": 1})
    engine = FlashMemoryEngine(num_threads=1, max_seq_len=600, **knobs)
    try:
        assert engine.stats()["L0_bytes_capacity"] <= 8 * 2**20 and knobs["active_window"] >= 256
    finally:
        engine.close()


def test_a_snapshot_of_other_tokens_is_refused_before_any_worker_starts(tiny_llama, tmp_path):
    import pytest

    from flashmemory.engine.engine import FlashMemoryEngine
    from flashmemory.errors import KVSnapshotError
    from flashmemory.model.loader import open_checkpoint
    from flashmemory.tools.bench.decode_compare import check_snapshot

    snapshot = tmp_path / "p.kvsnap"
    engine = FlashMemoryEngine(model_path=str(tiny_llama), kv_cache="contiguous", kv_precision="fp16")
    engine.score_tokens(list(range(3, 43)), num_teacher_forced=4, kv_snapshot=snapshot)
    engine.close()
    checkpoint = open_checkpoint(str(tiny_llama))
    assert check_snapshot(snapshot, checkpoint, list(range(3, 80))) == 36
    with pytest.raises(KVSnapshotError, match="differ at position 0"):
        check_snapshot(snapshot, checkpoint, list(range(4, 80)))
