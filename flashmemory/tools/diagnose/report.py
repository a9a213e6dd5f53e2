"""DiagnoseReport: the memory pathway of one measured run, stage by stage — where each byte lives, what moves
between levels and how fast, where each millisecond of a step goes — as named figures, text and JSON."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from flashmemory.kvcache.config import KV_DTYPE
from flashmemory.kvcache.kv_stats import KVStats
from flashmemory.kvcache.manager.blocks import Level, level_label
from flashmemory.tools.diagnose.pools import PoolLayout
from flashmemory.tools.diagnose.timers import PHASES, phases_of
from flashmemory.tools.diagnose.workload import Measurement

MIB = 2**20
SCHEMA = "flashmemory-diagnose/1"
ROUTES = ("new->L0", "new->L1", "L0->L1", "L1->L2", "L1->L0")  # reported first, then the others
# What each level's stage holds, by the level's name (LevelStats.name); another level shows its
# name.
STAGE_CONTENTS = {"device": "INT4 window, sinks; FP16 rows of newest tokens",
                  "host": "FP16 master copies", "disk": "INT4 cold file (INT2 with int2-disk)"}


@dataclass(frozen=True)
class Stage:
    """Bytes one stage of the pathway holds, where, and of what capacity."""

    name: str
    where: str  # "device", "host" or "disk"
    bytes: int | None  # None: not measurable here (the note says why)
    capacity_bytes: int | None = None
    note: str = ""


@dataclass
class StepTime:
    """Where the time of one kind of step goes (milliseconds per step, mean over the run's steps of that kind)."""

    kind: str
    steps: int
    tokens_per_step: float
    ms_per_step: float
    phases_ms: dict[str, float]  # PHASES -> ms per step
    parts_ms: dict[str, float]  # the timed parts -> ms per step

    def share(self, phase: str) -> float:
        return self.phases_ms[phase] / self.ms_per_step if self.ms_per_step else 0.0

    def part_share(self, part: str) -> float:
        return self.parts_ms.get(part, 0.0) / self.ms_per_step if self.ms_per_step else 0.0


@dataclass
class DiagnoseReport:
    """Everything `flashmemory diagnose` found; `figures` are the named numbers advice refers to."""

    model: str
    settings: dict[str, Any]
    workload: dict[str, Any]
    stages: list[Stage]
    pools: dict[str, PoolLayout]
    traffic: dict[str, Any]
    bandwidth: dict[str, Any]
    disk: dict[str, Any]
    selection: dict[str, Any]
    prefetch: dict[str, Any]
    time: dict[str, StepTime]
    figures: dict[str, float]
    warnings: list[str] = field(default_factory=list)
    advice: list = field(default_factory=list)  # advice.Advice, filled by advise()

    def to_dict(self) -> dict[str, Any]:
        from flashmemory.tools.diagnose.seed_actions import SEED_ACTIONS

        return {"schema": SCHEMA, "model": self.model, "settings": self.settings, "workload": self.workload,
                "stages": [asdict(s) for s in self.stages],
                "pools": {name: p.to_dict() for name, p in self.pools.items()}, "traffic": self.traffic,
                "bandwidth": self.bandwidth, "disk": self.disk, "selection": self.selection,
                "prefetch": self.prefetch, "time": {k: asdict(v) for k, v in self.time.items()},
                "figures": self.figures, "warnings": self.warnings, "advice": [a.to_dict() for a in self.advice],
                "seed_actions": [asdict(a) for a in SEED_ACTIONS]}


def _mean_step(kind: str, steps) -> StepTime | None:
    if not steps:
        return None
    n = len(steps)
    phases = {p: 0.0 for p in PHASES}
    parts: dict[str, float] = {}
    for s in steps:
        for p, sec in phases_of(s.parts, s.seconds).items():
            phases[p] += sec
        for part, sec in s.parts.items():
            parts[part] = parts.get(part, 0.0) + sec
    ms = 1000 / n
    return StepTime(kind, n, statistics.fmean(s.tokens for s in steps), sum(s.seconds for s in steps) * ms,
                    {p: v * ms for p, v in phases.items()}, {k: v * ms for k, v in sorted(parts.items())})


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / MIB:.1f} MiB"


def _moved(stats: KVStats) -> dict[str, int]:
    return {m.route: m.bytes for m in stats.moves}


def _bytes_read(stats: KVStats) -> dict[str, int]:
    """Bytes read back from each level whose medium counts them (a file), by label."""
    return {lv.label: lv.medium.bytes_read for lv in stats.levels
            if lv.medium.bytes_read is not None}


def _traffic(m: Measurement, cache, prefill_s: float, decode_s: float) -> dict[str, Any]:
    """Bytes moved between levels per second in each phase, reads of files, and what attention read
    per decode step."""
    out: dict[str, Any] = {"prefill": {}, "decode": {}}
    for phase, before, after, seconds in (("prefill", m.stats_before, m.stats_after_prefill, prefill_s),
                                          ("decode", m.stats_after_prefill, m.stats_end, decode_s)):
        moved_before, moved_after = _moved(before), _moved(after)
        for route in [*ROUTES, *(r for r in moved_after if r not in ROUTES)]:
            moved = moved_after.get(route, 0) - moved_before.get(route, 0)
            if moved:
                out[phase][route] = {"bytes": int(moved), "bytes_per_s": moved / seconds if seconds else 0.0}
        read_before = _bytes_read(before)
        for label, n in _bytes_read(after).items():
            read = n - read_before.get(label, 0)
            if read:
                out[phase][f"{label} read"] = {"bytes": int(read),
                                               "bytes_per_s": read / seconds if seconds else 0.0}
    steps = max(1, m.num_decode_tokens - 1)
    reads = {}
    if hasattr(cache, "levels"):
        for level, count in m.reads_decode.items():
            storage = cache.levels.get(level)
            if storage is None:
                continue
            per_head = storage.segment_bytes // cache.cfg.num_kv_heads  # a layer, block and head
            count -= m.row_reads_decode if level == Level.DEVICE else 0  # the rows are FP16: apart, below
            reads[level_label(level)] = {"blocks_per_step": count / steps,
                                         "bytes_per_step": count * per_head / steps}
        if m.row_reads_decode:
            # K and V of one block and KV head in FP16, as the row holds them (kvcache/recent_rows.py)
            per_head = 2 * cache.cfg.block_size * cache.cfg.head_dim * KV_DTYPE.itemsize
            reads["L0 rows"] = {"blocks_per_step": m.row_reads_decode / steps,
                                "bytes_per_step": m.row_reads_decode * per_head / steps}
    out["attention_reads_per_decode_step"] = reads
    return out


def _stages(engine, m: Measurement, activation_peak: int | None) -> list[Stage]:
    cache, s = engine.cache, m.stats_end
    plan = engine.device_plan
    workspace = plan.workspace_bytes if plan is not None else None
    out = [Stage("weights", "device", engine.model.num_parameter_bytes(), note="the model's parameters"),
           Stage("activation workspace", "device", activation_peak if activation_peak is not None else workspace,
                 None, f"measured peak during the run (start-up estimate {_mib(workspace)})"
                 if activation_peak is not None else "estimated from the shapes (engine/sizing.py): on a CPU the "
                 "process's RSS mixes activations with L1 pages, so it is not measured")]
    if s.contiguous is None:
        for lv in s.levels:
            name = f"KV {lv.label} ({STAGE_CONTENTS.get(lv.name, lv.name)})"
            on_disk = (lv.medium.bytes_committed or 0) / MIB
            note = ("at the run's end" if lv.level == Level.DEVICE
                    else f"the sparse file holds {on_disk:.1f} MiB on disk" if lv.name == "disk"
                    else "")
            out.append(Stage(name, lv.name, lv.bytes, lv.bytes_capacity, note))
            if lv.level == Level.DEVICE and s.staging is not None:
                out.append(Stage("L1 blocks staged on the device", "device",
                                 s.staging.device_staging_bytes,
                                 s.staging.device_staging_capacity_bytes))
            if lv.level == Level.HOST and s.prefetch is not None:
                out.append(Stage("L2 blocks prefetched into host memory", "host",
                                 s.prefetch.prefetch_staged_bytes,
                                 int(engine.config.prefetch_budget_mb * MIB)))
    else:
        out.append(Stage("KV (contiguous)", "device", s.contiguous.kv_bytes_used))
    out.append(Stage("gradients", "device", None, note="n/a: inference only (the seed's fourth pathway)"))
    return out


def build_report(engine, m: Measurement, disk: dict[str, Any], bandwidth: dict[str, Any],
                 activation_peak: int | None = None) -> DiagnoseReport:
    cache, cfg, s = engine.cache, engine.config, m.stats_end
    prefill, decode = _mean_step("prefill", m.steps_of("prefill")), _mean_step("decode", m.steps_of("decode"))
    time = {t.kind: t for t in (prefill, decode) if t is not None}
    prefill_s, decode_s = m.seconds("prefill"), m.seconds("decode")
    pools = {layout.level: layout for layout in m.pools.values()}
    traffic = _traffic(m, cache, prefill_s, decode_s)
    selection: dict[str, float | None] = {f"{lv.label}_selected_fraction": lv.selected_fraction
                                          for lv in s.levels if lv.candidate_blocks}
    reads = m.reads_decode
    total_reads = sum(reads.values())
    l0_share = reads.get(Level.DEVICE, 0) / total_reads if total_reads else None
    selection["L0_read_share"] = l0_share
    prefetch: dict[str, Any] = {"strategy": cfg.prefetch_strategy}
    if s.prefetch is not None:
        pf = s.prefetch
        prefetch.update(prefetch_hit_rate=pf.prefetch_hit_rate, prefetch_hits=pf.prefetch_hits,
                        prefetch_misses=pf.prefetch_misses,
                        prefetch_late_misses=pf.prefetch_late_misses,
                        prefetch_issued=pf.prefetch_issued,
                        prefetch_wasted_bytes=pf.prefetch_wasted_bytes)
    if s.staging is not None:
        staged = s.staging.device_staging_hits + s.staging.device_staging_misses
        hits = s.staging.device_staging_hits
        prefetch["device_staging_hit_rate"] = hits / staged if staged else 0.0
    figures = _figures(engine, m, time, pools, traffic, l0_share)
    settings = {name: getattr(cfg, name) for name in cfg.kv_field_names()}
    settings.update(dtype=str(engine.dtype).removeprefix("torch."), device=str(engine.device),
                    threads=torch.get_num_threads())
    workload = {"prompt_tokens": m.num_prompt_tokens, "decode_tokens": m.num_decode_tokens,
                "prefill_s": prefill_s, "decode_s": decode_s, "timer_events": m.timer_events,
                "timer_cost_us": m.timer_cost_s * 1e6,
                "timer_overhead_ms_per_decode_step": (m.timer_cost_s * m.timer_events / len(m.steps) * 1000
                                                      if m.steps else 0.0)}
    return DiagnoseReport(str(engine.model_path.name), settings, workload, _stages(engine, m, activation_peak),
                          pools, traffic, bandwidth, disk, selection, prefetch, time, figures)


def _figures(engine, m: Measurement, time: dict[str, StepTime], pools: dict[str, PoolLayout], traffic,
             l0_share: float | None) -> dict[str, float]:
    """The named numbers advice points at (and before/after comparisons read)."""
    s = m.stats_end
    f: dict[str, float] = {"weights_mib": engine.model.num_parameter_bytes() / MIB}
    decode = time.get("decode")
    if decode is not None:
        f["decode_ms_per_step"] = decode.ms_per_step
        f["decode_tokens_per_s"] = 1000 / decode.ms_per_step if decode.ms_per_step else 0.0
        for phase in PHASES:
            f[f"decode_{phase}_ms"] = decode.phases_ms[phase]
        f["decode_l2_read_ms"] = decode.parts_ms.get("l2_read", 0.0)
        f["decode_l2_read_share"] = decode.part_share("l2_read")
    if "prefill" in time:
        f["prefill_ms_per_step"] = time["prefill"].ms_per_step
    l0_stats = s.level("L0")
    if l0_stats is not None:
        f["l0_capacity_mib"] = l0_stats.bytes_capacity / MIB
        f["l0_used_mib"] = l0_stats.bytes / MIB
        l0 = next((p for p in pools.values() if p.level.startswith("L0")), None)
        if l0 is not None:
            f["l0_peak_slots"] = m.peak_l0_slots
            f["l0_capacity_slots"] = l0.capacity_slots
            f["l0_peak_use"] = m.peak_l0_slots / l0.capacity_slots if l0.capacity_slots else 0.0
    if engine.device_plan is not None:
        f["workspace_estimate_mib"] = engine.device_plan.workspace_bytes / MIB
    for lv in s.levels[1:]:
        f[f"{lv.label.lower()}_used_mib"] = lv.bytes / MIB
    reads = traffic["decode"].get("L2 read")
    f["decode_l2_read_mib_per_step"] = (reads["bytes"] / MIB / max(1, m.num_decode_tokens - 1)) if reads else 0.0
    if l0_share is not None:
        f["l0_read_share"] = l0_share
    f["sequence_tokens"] = m.num_prompt_tokens + m.num_decode_tokens
    return f
