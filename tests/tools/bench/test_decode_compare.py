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
    assert "| 24 | fm |" in table and "1 threads per engine; 2 interleaved rounds of 3" in table
