"""The report: every engine is a measured row or says why not; JSON round-trips; charts are PNG files."""

from __future__ import annotations

import pytest

from flashmemory.tools.bench.capacity import LimitCheck, longest_contexts
from flashmemory.tools.bench.engines import select_engines
from flashmemory.tools.bench.report import read_json, to_markdown, write_json
from flashmemory.tools.bench.runner import BenchReport
from flashmemory.tools.bench.summary import EngineRow, RunRecord, summarize

MIB = 2**20


def result(engine: str, prompt: int, decode: float, device: float) -> dict:
    return {"engine": engine, "prompt_tokens": prompt, "num_generated_tokens": 8, "prefill_tok_s": 100.0,
            "ttft_s": prompt / 100, "decode_tok_s": decode, "peak_rss_bytes": 900 * MIB, "device_kv_bytes": device,
            "device_kv_bytes_used": device, "host_kv_bytes": 0, "disk_kv_bytes": 0, "num_threads": 2}


@pytest.fixture
def report() -> BenchReport:
    specs = select_engines(["fm-exact", "fm-mixed", "hf-dynamic", "hf-static", "hf-offloaded"])
    lengths = [(512, 512), (2048, 2048)]
    runs = []
    for requested, prompt in lengths:
        for i, decode in enumerate((5.0, 7.0, 6.0)):  # median 6
            runs.append(RunRecord("fm-exact", requested, prompt, i, result("fm-exact", prompt, decode,
                                                                             prompt * 23040.0), None, 1.0))
            runs.append(RunRecord("fm-mixed", requested, prompt, i, result("fm-mixed", prompt, 2 * decode,
                                                                             16.0 * MIB), None, 1.0))
            runs.append(RunRecord("hf-dynamic", requested, prompt, i, result("hf-dynamic", prompt, decode,
                                                                               (prompt + 7) * 46080.0), None, 1.0))
    runs.append(RunRecord("hf-static", 2048, 2048, 0, None, "worker killed by SIGKILL (out of memory?)", 1.0))
    unavailable = {"hf-offloaded": "n/a: needs CUDA"}
    rows = summarize(runs, [s for s in specs if s.name not in unavailable], lengths)
    fidelity = [
        {"engine": "fm-exact", "decode_ppl": 20.0, "mean_kl": 0.0, "top1_agreement": 1.0, "reference": "fm-exact",
         "prefill_ppl": 21.0, "device_kv_bytes": 1, "error": None, "context_tokens": 2048,
         "teacher_forced_tokens": 64},
        {"engine": "fm-mixed", "decode_ppl": 20.2, "mean_kl": 0.004, "top1_agreement": 0.96, "reference": "fm-exact",
         "prefill_ppl": 21.0, "device_kv_bytes": 1, "error": None, "context_tokens": 2048,
         "teacher_forced_tokens": 64},
        {"engine": "hf-static", "decode_ppl": 0.0, "mean_kl": 0.0, "top1_agreement": 0.0, "reference": "",
         "prefill_ppl": None, "device_kv_bytes": None, "error": "worker killed", "context_tokens": 2048,
         "teacher_forced_tokens": 64},
    ]
    settings = {"command_settings": {"lengths_tokens": [512, 2048], "runs": 3, "decode_tokens": 8,
                                     "fidelity_tokens": 64, "threads": 2, "dtype": "float32", "quick": False,
                                     "engines": [s.name for s in specs]},
                "prompts_tokens": [512, 2048], "model": "/m/SmolLM2.gguf", "weights_folder": "/m",
                "model_limit_tokens": 8192, "fp16_kv_bytes_per_token": 23040, "budget_bytes": 45 * MIB,
                "text": "/t/alice29.txt", "text_tokens": 40000, "omp_wait_policy": "PASSIVE", "torch": "2.13.0",
                "transformers": "5", "python": "3.11", "machine": "x86_64", "cpu_count": 2, "cuda": False,
                "wall_s": 600.0}
    check = LimitCheck("fm-mixed-budget", 8175, 45 * MIB, None, None, "not run")
    capacity = longest_contexts(specs, rows, unavailable, 45 * MIB, 8192, "float32", None)
    return BenchReport(settings, specs, unavailable, rows, runs, fidelity, capacity, check)


def test_medians_and_failures_become_rows(report):
    exact = next(r for r in report.rows if r.engine == "fm-exact" and r.prompt_tokens == 2048)
    assert exact.status == "ok" and exact.decode_tok_s == 6.0 and exact.num_runs == 3
    assert exact.spread_decode == pytest.approx(2 / 6)
    static = next(r for r in report.rows if r.engine == "hf-static")
    assert static.status == "n/a" and "SIGKILL" in static.reason


def test_markdown_has_a_row_or_a_reason_for_every_engine(report):
    md = to_markdown(report)
    assert "| 2048 | fm-mixed | 16.0 | 0.0 | 0.0 | 900 | 100 | 20.48 | 12.00 | 2.00x | 33% |" in md
    assert "| 2048 | hf-static | n/a: worker killed by SIGKILL (out of memory?) |" in md
    assert "| hf-offloaded | n/a: needs CUDA |" in md
    assert "| fm-mixed | 16.0 | 20.200 | +1.00 % | 0.0040 | 96.0% | fm-exact |" in md
    assert "| hf-static | - | n/a: worker killed |" in md
    assert "| hf-dynamic | 45.00 | 0.0 | 1024 |" in md and "**8192** (limit)" in md
    assert "OMP_WAIT_POLICY=PASSIVE" in md and "2 threads" in md
    assert "Prefetch:" not in md  # no engine prefetched: no section


def test_the_json_report_reads_back_to_the_same_tables(report, tmp_path):
    path = tmp_path / "r.json"
    md = to_markdown(report)
    write_json(report, path, md)
    again = read_json(path)
    assert to_markdown(again) == md
    assert isinstance(again.rows[0], EngineRow) and again.limit_check.error == "not run"


def test_charts_are_written_as_png_files(report, tmp_path):
    pytest.importorskip("matplotlib")
    from flashmemory.tools.bench.charts import CHART_FILES, write_charts

    paths = write_charts(report, tmp_path / "charts")
    assert [p.name for p in paths] == list(CHART_FILES)
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000


def prefetch(hit_rate: float, hits: int, misses: int, ms: float | None) -> dict:
    return {"hit_rate": hit_rate, "issued": 40, "hits": hits, "misses": misses, "wasted_bytes": 2048,
            "predictor_ms_per_step": ms}


def test_prefetch_figures_get_medians_a_section_and_survive_the_json(report, tmp_path):
    specs = select_engines(["fm-mixed-disk", "fm-mixed-prefetch", "fm-mixed-prefetch-lru"])
    runs = []
    for i, (decode, rate, hits) in enumerate(((4.0, 0.5, 50), (6.0, 0.7, 70), (5.0, 0.6, 60))):
        runs.append(RunRecord("fm-mixed-disk", 2048, 2048, i, result("fm-mixed-disk", 2048, decode, MIB), None, 1.0))
        runs.append(RunRecord("fm-mixed-prefetch", 2048, 2048, i, {
            **result("fm-mixed-prefetch", 2048, 2 * decode, MIB), "prefetch": prefetch(rate, hits, 100 - hits, 0.25)},
            None, 1.0))
    runs.append(RunRecord("fm-mixed-prefetch-lru", 2048, 2048, 0, None, "worker killed", 1.0))
    rows = summarize(runs, specs, [(2048, 2048)])
    disk, pf, lru = rows
    assert disk.prefetch_hit_rate is None and disk.predictor_ms_per_step is None  # no prefetcher
    assert (pf.prefetch_hit_rate, pf.prefetch_hits, pf.prefetch_misses) == (0.6, 60, 40)
    assert pf.prefetch_issued == 40 and pf.prefetch_wasted_bytes == 2048 and pf.predictor_ms_per_step == 0.25
    assert lru.status == "n/a"
    report.engines, report.rows, report.runs, report.unavailable = specs, rows, runs, {}
    report.capacity = longest_contexts(specs, rows, {}, 45 * MIB, 8192, "float32", None)
    md = to_markdown(report)
    assert "Prefetch: L2 segment reads" in md
    assert "| 2048 | fm-mixed-disk | 5.00 | 1.00x | off | | | | | |" in md
    assert "| 2048 | fm-mixed-prefetch | 10.00 | 2.00x | 60.0% | 40 | 60 | 40 | 2.0 | 0.25 |" in md
    assert "| 2048 | fm-mixed-prefetch-lru | n/a: worker killed |" in md  # the speed table says why
    path = tmp_path / "r.json"
    write_json(report, path, md)
    again = read_json(path)
    assert to_markdown(again) == md and again.rows[1].prefetch_hit_rate == 0.6
