"""`flashmemory bench --decode-only`: persistent workers answer step commands in interleaved rounds."""

from __future__ import annotations

import json

from flashmemory.tools.bench.decode_compare import DecodeEngine, run_decode_compare, to_markdown


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
               DecodeEngine("fm-exact", "flashmemory", exact, "PASSIVE", threads=1))
    report = run_decode_compare(tiny_llama, ids_path, [30], rounds=2, steps=2, threads=1, engines=engines,
                                work_dir=tmp_path, kv_snapshot=snapshot, restore_chunk_tokens=8)
    rows = report["rows"]
    assert all(r["restored_tokens"] == 24 and len(r["step_ms"]) == 4 and r["peak_rss_mib"] > 0 for r in rows)
    table = to_markdown(report)
    assert "| 30 | fm-exact | 1 |" in table and "from p.kvsnap" in table


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
