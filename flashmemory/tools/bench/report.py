"""The benchmark as markdown (terminal, README) and JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flashmemory.tools.bench.capacity import LimitCheck, longest_contexts
from flashmemory.tools.bench.engines import ENGINES, PREFETCH_BASELINE_ENGINE, REFERENCE_ENGINE, EngineSpec
from flashmemory.tools.bench.runner import BenchReport
from flashmemory.tools.bench.summary import EngineRow, RunRecord
from flashmemory.errors import FlashMemoryError

MIB = 2**20
KIB = 2**10


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{max(n, 0.0) / MIB:.1f}"  # a fitted intercept may be a rounding below 0


def speed_table(report: BenchReport) -> str:
    head = ("| context | engine | device KV MiB | host KV MiB | disk KV MiB | peak RSS MiB | prefill tok/s | "
            "TTFT s | decode tok/s | decode vs fm-exact | decode spread |\n"
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    exact = {r.prompt_tokens: r for r in report.rows if r.engine == REFERENCE_ENGINE and r.status == "ok"}
    for r in report.rows:
        if r.status != "ok":
            lines.append(f"| {r.prompt_tokens} | {r.engine} | {r.reason} | | | | | | | | |")
            continue
        base = exact.get(r.prompt_tokens)
        ratio = f"{r.decode_tok_s / base.decode_tok_s:.2f}x" if base and base.decode_tok_s else "-"
        engine = f"{r.engine} ({r.reason})" if r.reason else r.engine  # some runs failed: say so
        lines.append(f"| {r.prompt_tokens} | {engine} | {_mib(r.device_kv_bytes)} | {_mib(r.host_kv_bytes)} | "
                     f"{_mib(r.disk_kv_bytes)} | {r.peak_rss_bytes / MIB:.0f} | {r.prefill_tok_s:.0f} | "
                     f"{r.ttft_s:.2f} | {r.decode_tok_s:.2f} | {ratio} | {r.spread_decode:.0%} |")
    return "\n".join(lines)


def prefetch_table(report: BenchReport) -> str:
    """Decode speed with and without the L2 prefetcher, and what it did: the engines that prefetch, next to the
    disk engine without prefetch; empty when none ran."""
    rows = [r for r in report.rows if r.status == "ok"
            and (r.prefetch_hit_rate is not None or r.engine == PREFETCH_BASELINE_ENGINE)]
    if not any(r.prefetch_hit_rate is not None for r in rows):
        return ""
    base = {r.prompt_tokens: r for r in rows if r.engine == PREFETCH_BASELINE_ENGINE}
    lines = ["Prefetch: L2 segment reads of the decode steps of each measured request (prefill reads are not "
             "ranked or counted), medians of the runs; "
             f"decode against {PREFETCH_BASELINE_ENGINE} (the same KV placement, no prefetch):", "",
             f"| context | engine | decode tok/s | decode vs {PREFETCH_BASELINE_ENGINE} | hit rate | issued | hits | "
             "misses | wasted KiB | predictor ms/step |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        b = base.get(r.prompt_tokens)
        ratio = f"{r.decode_tok_s / b.decode_tok_s:.2f}x" if b and b.decode_tok_s else "-"
        if r.prefetch_hit_rate is None:
            lines.append(f"| {r.prompt_tokens} | {r.engine} | {r.decode_tok_s:.2f} | {ratio} | off | | | | | |")
            continue
        ms = "-" if r.predictor_ms_per_step is None else f"{r.predictor_ms_per_step:.2f}"
        lines.append(f"| {r.prompt_tokens} | {r.engine} | {r.decode_tok_s:.2f} | {ratio} | {r.prefetch_hit_rate:.1%} | "
                     f"{r.prefetch_issued:.0f} | {r.prefetch_hits:.0f} | {r.prefetch_misses:.0f} | "
                     f"{(r.prefetch_wasted_bytes or 0.0) / KIB:.1f} | {ms} |")
    return "\n".join(lines)


def fidelity_table(report: BenchReport) -> str:
    if not report.fidelity:
        return ""
    context = report.fidelity[0]["context_tokens"]
    forced = report.fidelity[0]["teacher_forced_tokens"]
    device = {r.engine: r.device_kv_bytes for r in report.rows if r.prompt_tokens == context and r.status == "ok"}
    ppl = {f["engine"]: f["decode_ppl"] for f in report.fidelity if not f["error"]}
    lines = [f"Fidelity at {context} tokens (the last {forced} fed one at a time), against the reference's next-token "
             "distributions:", "",
             "| engine | device KV MiB | decode PPL | Δ PPL | mean KL | top-1 | reference |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for f in report.fidelity:
        if f["error"]:
            lines.append(f"| {f['engine']} | {_mib(device.get(f['engine']))} | n/a: {f['error']} | | | | |")
            continue
        ref_ppl = ppl.get(f["reference"])
        delta = f"{(f['decode_ppl'] / ref_ppl - 1) * 100:+.2f} %" if ref_ppl else "-"
        kl = max(f["mean_kl"], 0.0)  # a KL below 0 is float rounding of equal distributions
        lines.append(f"| {f['engine']} | {_mib(device.get(f['engine']))} | {f['decode_ppl']:.3f} | {delta} | "
                     f"{kl:.4f} | {f['top1_agreement']:.1%} | {f['reference']} |")
    return "\n".join(lines)


def capacity_table(report: BenchReport) -> str:
    budget = report.settings["budget_bytes"]
    per_token = report.settings["fp16_kv_bytes_per_token"]
    lines = [f"Longest context under a fixed device-KV budget of {budget / MIB:.1f} MiB (= an FP16 cache of "
             f"{budget // per_token} tokens); the model's limit is {report.settings['model_limit_tokens']} tokens:", "",
             "| engine | device KV KiB/token | fixed device KV MiB | longest context | why | checked |",
             "|---|---:|---:|---:|---|---|"]
    for c in report.capacity:
        if c.longest_tokens is None and c.bytes_per_token is None:
            lines.append(f"| {c.engine} | - | - | - | {c.why} | |")
            continue
        longest = "-" if c.longest_tokens is None else (
            f"**{c.longest_tokens}** (limit)" if c.reaches_limit else str(c.longest_tokens))
        lines.append(f"| {c.engine} | {c.bytes_per_token / KIB:.2f} | {_mib(c.fixed_bytes)} | {longest} | {c.why} | "
                     f"{c.verified} |")
    return "\n".join(lines)


def unavailable_table(report: BenchReport) -> str:
    if not report.unavailable:
        return ""
    rows = "\n".join(f"| {name} | {reason} |" for name, reason in report.unavailable.items())
    return "Not measured here:\n\n| engine | reason |\n|---|---|\n" + rows


def legend(report: BenchReport) -> str:
    return "\n".join(f"- `{e.name}`: {e.description}" for e in report.engines)


def settings_line(report: BenchReport) -> str:
    s, c = report.settings, report.settings["command_settings"]
    return (f"Model {Path(s['model']).name} ({s['model_limit_tokens']}-token limit), text {Path(s['text']).name}; "
            f"{c['decode_tokens']} greedy decode tokens, median of {c['runs']} interleaved run(s), one process per "
            f"run; {c['threads']} threads, OMP_WAIT_POLICY={s['omp_wait_policy']}, dtype {c['dtype']}; torch "
            f"{s['torch']}, transformers {s['transformers']}, {s['machine']}, {s['cpu_count']} CPUs, CUDA "
            f"{'yes' if s['cuda'] else 'no'}; {s['wall_s'] / 60:.0f} min in all.{_cpu_line(s)}")


def _cpu_line(s: dict) -> str:
    if "cpu" not in s:  # a report written before the CPU was recorded
        return ""
    load = s["llamacpp_load"]
    return (f" CPU {s['cpu']['model']} ({', '.join(s['cpu']['flags'])}); llama.cpp's extra "
            "buffer types "
            f"{'on' if load['extra_buffer_types'] else 'off'} ({load['why']}).")


def to_markdown(report: BenchReport) -> str:
    parts = [speed_table(report), prefetch_table(report), fidelity_table(report), capacity_table(report), unavailable_table(report),
             "Engines:\n\n" + legend(report), settings_line(report)]
    return "\n\n".join(p for p in parts if p) + "\n"


def write_json(report: BenchReport, path: Path, markdown: str) -> None:
    data: dict[str, Any] = report.to_json()
    data["markdown"] = markdown
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))


def read_json(path: Path) -> BenchReport:
    """A report written by write_json, to print its tables or draw its charts again without measuring."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise FlashMemoryError(f"cannot read the bench report {str(path)!r}: {e}") from e
    known = {e.name: e for e in ENGINES}
    engines = [known.get(e["name"]) or EngineSpec(e["name"], e["family"], e["description"], e["settings"])
               for e in data["engines"]]
    check = LimitCheck(**data["limit_check"]) if data.get("limit_check") else None
    rows = [EngineRow(**r) for r in data["rows"]]
    settings = data["settings"]
    # Derived from the measured rows, so it is computed again (as the current code computes it).
    capacity = longest_contexts(engines, rows, data["unavailable"], settings["budget_bytes"],
                                settings["model_limit_tokens"], settings["command_settings"]["dtype"], check)
    return BenchReport(settings=settings, engines=engines, unavailable=data["unavailable"], rows=rows,
                       runs=[RunRecord(**r) for r in data["runs"]], fidelity=data["fidelity"], capacity=capacity,
                       limit_check=check)
