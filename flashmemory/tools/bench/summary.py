"""Medians over the interleaved runs: one row per engine and context length, measured or with its reason."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from flashmemory.tools.bench.engines import EngineSpec

MEDIAN_FIELDS = ("prefill_tok_s", "ttft_s", "decode_tok_s", "peak_rss_bytes", "device_kv_bytes",
                 "device_kv_bytes_used", "host_kv_bytes", "disk_kv_bytes")
# EngineRow field <- the runs' PrefetchFigures field (prefetch_figures.py), medians of the runs that have them.
PREFETCH_FIELDS = {"prefetch_hit_rate": "hit_rate", "prefetch_issued": "issued", "prefetch_hits": "hits",
                   "prefetch_misses": "misses", "prefetch_wasted_bytes": "wasted_bytes",
                   "predictor_ms_per_step": "predictor_ms_per_step"}


@dataclass
class RunRecord:
    """One worker run: its figures, or why there are none."""

    engine: str
    requested_tokens: int
    prompt_tokens: int
    run_index: int
    result: dict[str, Any] | None
    error: str | None
    wall_s: float


@dataclass
class EngineRow:
    """Medians of one engine at one context length (status "ok"), or the reason it has none (status "n/a")."""

    engine: str
    family: str
    requested_tokens: int
    prompt_tokens: int
    status: str
    reason: str = ""
    num_runs: int = 0
    num_generated_tokens: int = 0
    num_threads: int = 0
    prefill_tok_s: float = 0.0
    ttft_s: float = 0.0
    decode_tok_s: float = 0.0
    peak_rss_bytes: float = 0.0
    device_kv_bytes: float = 0.0
    device_kv_bytes_used: float = 0.0
    host_kv_bytes: float = 0.0
    disk_kv_bytes: float = 0.0
    spread_decode: float = 0.0  # (max - min) / median of decode tok/s over the runs: how noisy the machine was
    # The L2 prefetcher over the measured request (None: the engine runs no prefetcher).
    prefetch_hit_rate: float | None = None  # fraction of L2 segment reads served from the staging area
    prefetch_issued: float | None = None  # L2 segment reads queued ahead
    prefetch_hits: float | None = None
    prefetch_misses: float | None = None
    prefetch_wasted_bytes: float | None = None  # prefetched and dropped unread
    predictor_ms_per_step: float | None = None  # ranking time per decode step


def summarize(runs: list[RunRecord], specs: list[EngineSpec], lengths: list[tuple[int, int]]) -> list[EngineRow]:
    """Rows in (length, engine) order for the engines that could run; lengths are (requested, prompt) tokens."""
    rows = []
    for requested, prompt in lengths:
        for spec in specs:
            mine = [r for r in runs if r.engine == spec.name and r.prompt_tokens == prompt]
            if not mine:
                continue
            ok = [r.result for r in mine if r.result is not None]
            if not ok:
                rows.append(EngineRow(spec.name, spec.family, requested, prompt, "n/a",
                                      reason=f"n/a: {mine[0].error}"))
                continue
            row = EngineRow(spec.name, spec.family, requested, prompt, "ok", num_runs=len(ok),
                            num_generated_tokens=ok[0]["num_generated_tokens"], num_threads=ok[0]["num_threads"])
            for name in MEDIAN_FIELDS:
                setattr(row, name, statistics.median(float(r[name]) for r in ok))
            _prefetch_medians(row, [r["prefetch"] for r in ok if r.get("prefetch")])
            speeds = [float(r["decode_tok_s"]) for r in ok]
            if row.decode_tok_s > 0:
                row.spread_decode = (max(speeds) - min(speeds)) / row.decode_tok_s
            if len(ok) < len(mine):
                first_error = next(r.error for r in mine if r.error)
                row.reason = f"{len(mine) - len(ok)} of {len(mine)} runs failed: {first_error}"
            rows.append(row)
    return rows


def _prefetch_medians(row: EngineRow, figures: list[dict[str, Any]]) -> None:
    for name, key in PREFETCH_FIELDS.items():
        values = [float(f[key]) for f in figures if f.get(key) is not None]
        if values:
            setattr(row, name, statistics.median(values))
