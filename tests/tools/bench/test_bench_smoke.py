"""`flashmemory bench --quick` end to end on a tiny random model: real worker processes, real numbers."""

from __future__ import annotations

import importlib.util
import json

import torch

from flashmemory.cli import EXIT_ERROR, main

TEXT = "Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to do. " * 40
PROMPT = 96
DECODE = 8  # --quick
# Tiny model (tests/helpers.py): 2 layers, 2 KV heads, head_dim 16.
FP16_TOKEN_BYTES = 2 * 2 * 2 * 16 * 2


def test_quick_bench_measures_each_engine_or_says_why_not(tiny_llama, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    out_json, charts = tmp_path / "bench.json", tmp_path / "charts"
    rc = main(["bench", "--quick", "--model", str(tiny_llama), "--text", str(text), "--lengths", str(PROMPT),
               "--threads", "1", "--engines", "fm-exact", "fm-mixed", "fm-mixed-prefetch", "hf-dynamic", "hf-offloaded",
               "llamacpp-f16", "fm-cuda-int4", "--json", str(out_json), "--charts-dir", str(charts)])
    out = capsys.readouterr().out
    assert rc == 0
    report = json.loads(out_json.read_text())
    assert report["markdown"] in out

    rows = {r["engine"]: r for r in report["rows"]}
    assert set(rows) == {"fm-exact", "fm-mixed", "fm-mixed-prefetch", "hf-dynamic"}
    for r in rows.values():
        assert r["status"] == "ok" and r["prompt_tokens"] == PROMPT and r["num_runs"] == 1
        assert r["num_threads"] == 1  # --threads reached every worker
        assert r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0 and r["peak_rss_bytes"] > 50 * 2**20
    # Bytes of the tokens held as the request ended: the prompt and every generated token but the last.
    held = PROMPT + DECODE - 1
    assert rows["fm-exact"]["device_kv_bytes_used"] == held * FP16_TOKEN_BYTES
    assert rows["hf-dynamic"]["device_kv_bytes"] == held * 2 * FP16_TOKEN_BYTES  # float32 K/V
    assert rows["fm-mixed"]["device_kv_bytes"] > 0 and rows["fm-mixed"]["device_kv_bytes_used"] > 0
    # The disk engines size window and warm span to the length: half of the 96 tokens reached L2, and the
    # prefetcher's figures are real ones (fm-mixed keeps everything off L2 and runs no prefetcher).
    assert rows["fm-mixed"]["disk_kv_bytes"] == 0 and rows["fm-mixed"]["prefetch_hit_rate"] is None
    pf = rows["fm-mixed-prefetch"]
    assert pf["disk_kv_bytes"] > 0
    assert 0 <= pf["prefetch_hit_rate"] <= 1 and pf["prefetch_issued"] >= 0 and pf["prefetch_wasted_bytes"] >= 0
    assert pf["prefetch_hits"] + pf["prefetch_misses"] > 0  # decode steps read L2 through the prefetcher
    assert pf["predictor_ms_per_step"] is not None and pf["predictor_ms_per_step"] >= 0
    assert "Prefetch: L2 segment reads" in out and "| 96 | fm-mixed-prefetch | " in out

    reasons = report["unavailable"]
    if not torch.cuda.is_available():
        assert "needs CUDA" in reasons["hf-offloaded"]
        # torchao's weight-only engine is reported, not skipped, nor run on the CPU's kernels under its name
        assert reasons["fm-cuda-int4"].startswith("n/a: needs CUDA, no CUDA device")
        assert "| fm-cuda-int4 | n/a: " in out
    assert reasons["llamacpp-f16"].startswith("n/a: ")  # a folder model; or llama-cpp-python missing
    assert "| hf-offloaded | n/a: " in out and "| llamacpp-f16 | n/a: " in out

    fidelity = {f["engine"]: f for f in report["fidelity"]}
    assert fidelity["fm-exact"]["mean_kl"] == 0 and fidelity["fm-exact"]["top1_agreement"] == 1
    # Same weights, float32 K/V: transformers agrees with the exact FP16 cache up to FP16 rounding of K/V.
    assert fidelity["hf-dynamic"]["error"] is None and abs(fidelity["hf-dynamic"]["mean_kl"]) < 1e-3
    # KL >= 0 up to the float32 rounding of the log-softmax rows (here it is ~0 and can come out at -5e-8)
    assert fidelity["fm-mixed"]["error"] is None and fidelity["fm-mixed"]["mean_kl"] >= -1e-6
    assert all(f["context_tokens"] == PROMPT and f["teacher_forced_tokens"] == 16 for f in fidelity.values())

    capacity = {c["engine"]: c for c in report["capacity"]}
    assert set(capacity) == {"fm-exact", "fm-mixed", "fm-mixed-prefetch", "hf-dynamic", "hf-offloaded",
                             "llamacpp-f16", "fm-cuda-int4"}
    assert capacity["hf-dynamic"]["bytes_per_token"] == 2 * FP16_TOKEN_BYTES
    assert report["settings"]["omp_wait_policy"] and report["settings"]["command_settings"]["threads"] == 1

    if importlib.util.find_spec("matplotlib") is not None:
        pngs = sorted(p.name for p in charts.glob("*.png"))
        assert pngs == ["decode_speed.png", "fidelity_vs_device_bytes.png", "kv_device_memory.png"]


def test_bench_rejects_bad_flags_before_measuring(capsys):
    assert main(["bench", "--lengths", "lots"]) == EXIT_ERROR
    assert "error: --lengths 'lots'" in capsys.readouterr().err
    assert main(["bench", "--runs", "0"]) == EXIT_ERROR
    assert "--runs 0" in capsys.readouterr().err
    assert main(["bench", "--engines", "vllm"]) == EXIT_ERROR
    assert "unknown engine 'vllm'" in capsys.readouterr().err


def test_list_engines_says_which_can_run_here(capsys):
    assert main(["bench", "--list-engines"]) == 0
    out = capsys.readouterr().out
    assert "fm-mixed-budget" in out and "hf-quanto-int4" in out and "llamacpp-q4_0-fa" in out


def test_fidelity_longer_than_the_prompt_fails_before_any_run(tiny_llama, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    rc = main(["bench", "--model", str(tiny_llama), "--text", str(text), "--lengths", "32", "--fidelity-tokens", "64"])
    assert rc == EXIT_ERROR
    err = capsys.readouterr().err
    assert "--fidelity-tokens 64 must be smaller than the longest prompt (32 tokens)" in err and "run 1/" not in err
