"""The MATS-3 report: latency per time window and its drift, RSS and disk at the run's marks, the RSS pass/fail
figure, 5xx and failed requests, KV blocks left when idle, and the GPU's health where there is one."""

from __future__ import annotations

from flashmemory.tools.mats.endurance_run import EnduranceRun, Sample
from flashmemory.tools.mats.gpu_watch import ECC_CORRECTED_WARN, TEMPERATURE_WARN_C, GpuSummary
from flashmemory.tools.mats.options import MatsOptions
from flashmemory.tools.mats.report import Check, ErrorLog, SuiteReport, Table
from flashmemory.tools.mats.traffic import RequestRecord

MIB = 2**20
MARKS = ("first request", "end of load", "idle")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def build_report(options: MatsOptions, run: EnduranceRun, gpu: GpuSummary | None, gpu_skipped: str | None
                 ) -> SuiteReport:
    report = SuiteReport("MATS-3", "endurance", options.seed, options.duration_s, elapsed_s=run.loaded_s)
    records = ([run.first] if run.first is not None else []) + run.records
    report.ops = len(records)
    errors = _errors(run, records)
    window_s = options.window_s or max(1.0, options.duration_s / 10)
    windows = _windows(run.records, window_s, run.samples)
    report.tables.append(Table(f"Latency per {window_s:g}-s window (TTFT and inter-token latency of streamed "
                               "requests, ms)", ["window", "requests", "failed", "TTFT p50", "TTFT p90", "ITL p50",
                                                 "ITL p90", "RSS MiB"], windows))
    report.tables.append(_marks_table(run))
    report.counters = _counters(run, records, windows)
    report.checks += _checks(options, run, records, report.counters)
    _gpu(report, gpu, gpu_skipped)
    held = _held_blocks(run)
    if held:
        errors.add("leak", f"{held:.0f} KV blocks still held after {options.idle_s:g} s idle")
    report.take_errors(errors)
    report.notes += [f"server: {' '.join(run.server.args[1:])}",
                     f"model loaded and ready in {run.load_s:.1f} s; {options.concurrency} clients; "
                     f"load {run.loaded_s:.1f} s, then {options.idle_s:g} s idle; server exit status {run.exit_status}"]
    if run.failure or run.server_died:
        report.notes.append("server log (last lines):\n" + run.log_tail)
    return report


def _errors(run: EnduranceRun, records: list[RequestRecord]) -> ErrorLog:
    errors = ErrorLog()
    for r in records:
        if r.error is None:
            continue
        kind = "5xx" if (r.status or 0) >= 500 else ("bad request not refused" if r.expected_failure
                                                     else "request failed")
        errors.add(kind, f"{r.kind} request at {r.started_s:.1f} s: {r.error}")
    if run.failure:
        errors.add("server", run.failure)
    if run.server_died:
        errors.add("server", "the server process exited while it was under load")
    return errors


def _windows(records: list[RequestRecord], window_s: float, samples: list[Sample]) -> list[list]:
    if not records:
        return []
    rows = []
    for w in range(int(max(r.started_s for r in records) // window_s) + 1):
        mine = [r for r in records if w * window_s <= r.started_s < (w + 1) * window_s]
        ttft = [r.ttft_s * 1000 for r in mine if r.ttft_s is not None]
        itl = [x * 1000 for r in mine for x in r.itl_s]
        rss = [s.rss_bytes for s in samples if s.t_s <= (w + 1) * window_s and s.rss_bytes]
        rows.append([f"{w * window_s:g}-{(w + 1) * window_s:g} s", len(mine), sum(1 for r in mine if not r.ok),
                     percentile(ttft, 50), percentile(ttft, 90), percentile(itl, 50), percentile(itl, 90),
                     rss[-1] / MIB if rss else float("nan")])
    return rows


def _marks_table(run: EnduranceRun) -> Table:
    rows = []
    for name in MARKS:
        sample, kv = run.marks.get(name), run.kv.get(name, {})
        rss = sample.rss_bytes / MIB if sample is not None and sample.rss_bytes else float("nan")
        disk = sample.disk_bytes / MIB if sample is not None else float("nan")
        blocks = "/".join(f"{kv.get(f'kv_blocks L{i}', float('nan')):.0f}" for i in range(3))
        committed = "/".join(f"{kv.get(f'kv_bytes_committed L{i}', float('nan')) / MIB:.1f}" for i in range(3))
        rows.append([name, rss, disk, blocks, committed])
    return Table("The server at each mark", ["mark", "RSS MiB", "cold-zone disk MiB", "KV blocks L0/L1/L2",
                                             "KV committed MiB L0/L1/L2"], rows)


def _counters(run: EnduranceRun, records: list[RequestRecord], windows: list[list]) -> dict[str, float]:
    out: dict[str, float] = {"requests": len(records)}
    for kind in sorted({r.kind for r in records}):
        out[f"requests {kind}"] = sum(1 for r in records if r.kind == kind)
    out["requests streamed"] = sum(1 for r in records if r.streamed)
    out["requests aborted by the client"] = sum(1 for r in records if r.aborted)
    out["bad requests refused (4xx)"] = sum(1 for r in records if r.expected_failure and r.ok)
    out["responses 5xx"] = sum(1 for r in records if (r.status or 0) >= 500)
    out["tokens received"] = sum(r.num_tokens for r in records)
    out["requests per second"] = len(run.records) / run.loaded_s if run.loaded_s else 0.0
    with_data = [row for row in windows if row[3] == row[3]]  # NaN != NaN: windows with a streamed request
    if with_data:
        first, last = with_data[0], with_data[-1]
        for name, col in (("TTFT p50", 3), ("TTFT p90", 4), ("ITL p50", 5), ("ITL p90", 6)):
            out[f"{name} ms first window"] = first[col]
            out[f"{name} ms last window"] = last[col]
            out[f"{name} drift (last / first)"] = last[col] / first[col] if first[col] else float("nan")
    for name in MARKS:
        sample = run.marks.get(name)
        if sample is not None:
            out[f"RSS MiB at {name}"] = sample.rss_bytes / MIB if sample.rss_bytes else float("nan")
            out[f"cold-zone disk MiB at {name}"] = sample.disk_bytes / MIB
    rss = [s.rss_bytes for s in run.samples if s.rss_bytes]
    if rss:
        out["RSS MiB peak"] = max(rss) / MIB
    return out


def _checks(options: MatsOptions, run: EnduranceRun, records: list[RequestRecord],
            counters: dict[str, float]) -> list[Check]:
    failed = sum(1 for r in records if not r.ok)
    five = sum(1 for r in records if (r.status or 0) >= 500)
    checks = [
        Check("5xx responses", five, "== 0", five == 0, "no request is designed to fail with a 5xx"),
        Check("failed requests", failed, "== 0", failed == 0, "bad requests must get a 4xx; aborts are not failures"),
        Check("server up until stopped", not run.server_died and run.failure is None, "true",
              not run.server_died and run.failure is None),
        Check("KV blocks held when idle", _held_blocks(run), "== 0", _held_blocks(run) == 0),
    ]
    first, idle = run.marks.get("first request"), run.marks.get("idle")
    limit = f"<= {1 + options.rss_tolerance:.2f} x first, after >= {options.rss_requests} requests"
    if first is None or idle is None or not first.rss_bytes or not idle.rss_bytes:
        checks.append(Check("RSS idle / first request", "unknown", limit, None, "RSS could not be read"))
    else:
        ratio = idle.rss_bytes / first.rss_bytes
        value = f"{ratio:.3f} ({idle.rss_bytes / MIB:.0f} / {first.rss_bytes / MIB:.0f} MiB, {len(records)} requests)"
        if len(records) < options.rss_requests:
            checks.append(Check("RSS idle / first request", value, limit, None,
                                f"not judged: {len(records)} requests < {options.rss_requests} (run longer)"))
        else:
            checks.append(Check("RSS idle / first request", value, limit, ratio <= 1 + options.rss_tolerance))
    return checks


def _held_blocks(run: EnduranceRun) -> float:
    kv = run.kv.get("idle", {})
    return sum(v for k, v in kv.items() if k.startswith("kv_blocks"))


def _gpu(report: SuiteReport, gpu: GpuSummary | None, skipped: str | None) -> None:
    if gpu is None:
        report.notes.append(f"GPU temperature, clocks and ECC counters: {skipped}")
        report.checks.append(Check("GPU health (NVML)", skipped, "-", None))
        return
    report.tables.append(Table("GPU health (NVML)", list(gpu.gpus[0]), [list(g.values()) for g in gpu.gpus]))
    for g in gpu.gpus:
        uncorrected = g["ecc_uncorrected_delta"]
        report.checks.append(Check(f"GPU {g['gpu']} uncorrected ECC errors during the run",
                                   "n/a" if uncorrected is None else uncorrected, "== 0",
                                   None if uncorrected is None else uncorrected == 0,
                                   "ECC off or not supported" if uncorrected is None else ""))
        if (g["temperature_c_max"] or 0) > TEMPERATURE_WARN_C:
            report.warnings.append(f"GPU {g['gpu']} reached {g['temperature_c_max']} °C "
                                   f"(threshold {TEMPERATURE_WARN_C} °C)")
        if (g["ecc_corrected_delta"] or 0) > ECC_CORRECTED_WARN:
            report.warnings.append(f"ECC corrected errors = {g['ecc_corrected_delta']} in {report.elapsed_s:.0f} s "
                                   f"(threshold: {ECC_CORRECTED_WARN}) -> check the GPU's cooling")
