"""diagnose(): run the measured workload on an engine and build the report (the Python form of
`flashmemory diagnose`, as seed 004's `diagnose_memory_pathways(model, input_ids)` was a function)."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from flashmemory.engine.sizing import cold_zone_folder
from flashmemory.tools.diagnose.advice import advise
from flashmemory.tools.diagnose.report import DiagnoseReport, build_report
from flashmemory.tools.diagnose.workload import run_workload

COPY_BYTES = 64 * 2**20


def host_device_bandwidth(device: torch.device, repeats: int = 3) -> dict[str, Any]:
    """Pinned host -> device and device -> host copy speed (GB/s, median of `repeats` 64 MiB copies)."""
    if device.type != "cuda":
        return {"summary": "n/a: no GPU"}
    host = torch.empty(COPY_BYTES, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    out: dict[str, Any] = {}
    for name, dst, src in (("h2d_gb_s", dev, host), ("d2h_gb_s", host, dev)):
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize(device)
            started = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - started)
        out[name] = COPY_BYTES / statistics.median(times) / 1e9
    out["summary"] = f"host -> device {out['h2d_gb_s']:.1f} GB/s, device -> host {out['d2h_gb_s']:.1f} GB/s (pinned)"
    return out


def cold_zone_disk(engine, seconds: float) -> dict[str, Any]:
    """The cold zone folder's measured read speed (tools/disk_probe.py), or why it was not measured."""
    from flashmemory.tools.disk_probe import probe_disk

    cfg = engine.config
    if cfg.kv_cache != "tiered" or not cfg.cold_zone_enabled:
        return {"summary": "n/a: no cold zone"}
    if seconds <= 0:
        return {"summary": "not measured (--disk-seconds 0)"}
    try:
        return probe_disk(cold_zone_folder(cfg), seconds=seconds).to_dict()
    except OSError as e:
        return {"summary": f"not measured: {e.strerror or e}"}


def diagnose(engine, prompt_ids: list[int], decode_tokens: int = 32, disk_seconds: float = 1.0,
             with_advice: bool = True) -> DiagnoseReport:
    """Measure one prompt's prefill and `decode_tokens` decode steps on `engine` and report its memory pathway."""
    activation_peak = None
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
        base = torch.cuda.memory_allocated(engine.device)
        torch.cuda.reset_peak_memory_stats(engine.device)
    measurement = run_workload(engine, prompt_ids, decode_tokens)
    if engine.device.type == "cuda":
        activation_peak = torch.cuda.max_memory_allocated(engine.device) - base
    report = build_report(engine, measurement, cold_zone_disk(engine, disk_seconds),
                          host_device_bandwidth(engine.device), activation_peak)
    return advise(report, engine) if with_advice else report
