"""The diagnose report as text: the pathway stage by stage, then time, warnings and (with --advise) advice."""

from __future__ import annotations

from flashmemory.tools.diagnose.report import MIB, DiagnoseReport
from flashmemory.tools.diagnose.seed_actions import SEED_ACTIONS
from flashmemory.tools.diagnose.timers import PHASES


def _mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / MIB:,.1f} MiB"


def _rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e6:,.1f} MB/s"


def render(report: DiagnoseReport, with_advice: bool) -> str:
    w = report.workload
    lines = [f"Memory pathway of {report.model}: {w['prompt_tokens']} prompt tokens prefilled in "
             f"{w['prefill_s']:.1f} s, {w['decode_tokens']} tokens decoded in {w['decode_s']:.1f} s "
             f"({report.settings['device']}, {report.settings['dtype']}, {report.settings['threads']} threads)", ""]
    lines.append("Where the bytes live (stage by stage)")
    for stage in report.stages:
        cap = f" of {_mib(stage.capacity_bytes)}" if stage.capacity_bytes else ""
        note = f"  ({stage.note})" if stage.note else ""
        lines.append(f"  {stage.where:6s} {stage.name:44s} {_mib(stage.bytes):>12s}{cap}{note}")
    if report.pools:
        lines += ["", "KV pools at the run's end (slots; a hole is a free slot below the highest used one)"]
        for p in report.pools.values():
            lines.append(f"  {p.level:10s} {p.used_slots:7,d} of {p.capacity_slots:,d} slots used "
                         f"({_mib(p.used_bytes)} of {_mib(p.capacity_bytes)}); {p.free_runs} free run(s), largest "
                         f"{p.largest_free_run:,d}; holes {p.holes:,d} = {p.hole_share:.1%} of capacity; committed "
                         f"by the OS {_mib(p.committed_bytes)} ({_mib(p.committed_unused_bytes)} holding no block)")
    lines += ["", "Traffic between levels (measured)"]
    for phase in ("prefill", "decode"):
        moved = report.traffic[phase]
        if moved:
            lines.append(f"  {phase:8s} " + "; ".join(f"{route} {_mib(v['bytes'])} at {_rate(v['bytes_per_s'])}"
                                                     for route, v in moved.items()))
    reads = report.traffic.get("attention_reads_per_decode_step", {})
    if reads:
        lines.append("  decode attention reads per step: " + "; ".join(
            f"{lvl} {r['blocks_per_step']:,.0f} block-heads ({_mib(r['bytes_per_step'])})" for lvl, r in reads.items()))
    bw = report.bandwidth
    lines.append(f"  host <-> device bandwidth: {bw.get('summary', 'n/a')}")
    d = report.disk
    if "random_iops_parallel" in d:
        lines.append(f"  cold zone disk {d['folder']} ({d['filesystem']}, {d['method']}): {d['sequential_mb_s']:,.0f} "
                     f"MB/s sequential, {d['random_iops_parallel']:,.0f} random 4 KiB IOPS ({d['threads']} threads), "
                     f"{d['random_iops_qd1']:,.0f} one at a time (p50 {d['random_latency_us_p50']:.0f} us)")
    else:
        lines.append(f"  cold zone disk: {d.get('summary', 'n/a')}")
    sel = report.selection
    lines += ["", "Selection and prefetch"]
    parts = [f"{key.removesuffix('_selected_fraction')} {value:.1%} of candidate blocks"
             for key, value in sel.items() if key.endswith("_selected_fraction")]
    lines.append("  selected per decode step: " + (", ".join(parts) if parts else "nothing to select (all in L0)"))
    if sel.get("L0_read_share") is not None:
        lines.append(f"  L0 served {sel['L0_read_share']:.1%} of the blocks decode steps read")
    pf = report.prefetch
    if "prefetch_hit_rate" in pf:
        lines.append(f"  prefetch ({pf['strategy']}): L2 hit rate {pf['prefetch_hit_rate']:.1%} "
                     f"({pf['prefetch_hits']} hits, {pf['prefetch_misses']} misses, {pf['prefetch_late_misses']} late)")
    else:
        lines.append(f"  prefetch: {pf['strategy']}")
    if "device_staging_hit_rate" in pf:
        lines.append(f"  device staging hit rate {pf['device_staging_hit_rate']:.1%}")
    lines += ["", "Time per step (ms; overhead = norms, RoPE, activations, sampling, scheduling, Python)"]
    lines.append(f"  {'step':8s} {'steps':>5s} {'total':>8s} " + " ".join(f"{p:>10s}" for p in PHASES))
    for t in report.time.values():
        lines.append(f"  {t.kind:8s} {t.steps:5d} {t.ms_per_step:8.1f} " + " ".join(
            f"{t.phases_ms[p]:6.1f} {t.share(p):3.0%}" for p in PHASES))
    lines.append(f"  (timers: {w['timer_events']:,} events, ~{w['timer_overhead_ms_per_decode_step']:.2f} ms per "
                 "step of their own, counted in overhead)")
    lines += ["", "Figures (the names advice refers to)"]
    figures = [f"{name} {value:,.3g}" if isinstance(value, float) else f"{name} {value:,}"
               for name, value in report.figures.items()]
    lines += [f"  {'; '.join(figures[i:i + 4])}" for i in range(0, len(figures), 4)]
    if report.warnings:
        lines += ["", "Warnings"] + [f"  ! {text}" for text in report.warnings]
    if with_advice:
        lines += ["", "Advice"]
        if not report.advice:
            lines.append("  nothing to change for this workload")
        for i, a in enumerate(report.advice, 1):
            tag = f" (seed 004 action {a.seed_action})" if a.seed_action else ""
            lines += [f"  {i}. {a.headline}{tag}", f"     why: {a.reason}", f"     expect: {a.expected}",
                      f"     flags: {a.flags}"]
        lines += ["", "Seed 004's twelve tuning actions here"]
        for action in SEED_ACTIONS:
            where = ", ".join(action.settings) if action.settings else "n/a"
            lines.append(f"  {action.number:2d}. {action.action} -> {where}: {action.here}")
    return "\n".join(lines)
