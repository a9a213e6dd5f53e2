"""DoctorReport: every check of `flashmemory doctor` run in order, as text or JSON (docs/doctor.md)."""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from dataclasses import asdict, dataclass

from flashmemory.config import EngineConfig
from flashmemory.tools.doctor import checks
from flashmemory.tools.doctor.checks import STATUSES, Check
from flashmemory.version import __version__

SCHEMA = "flashmemory-doctor/1"


@dataclass
class DoctorReport:
    """The checks' results and where they ran."""

    checks: list[Check]
    settings: dict
    platform: dict

    @property
    def counts(self) -> dict[str, int]:
        return {status: sum(c.status == status for c in self.checks) for status in STATUSES}

    @property
    def ok(self) -> bool:
        """No check failed (warnings leave FlashMemory working, slower or closer to a limit)."""
        return self.counts["fail"] == 0

    def to_dict(self) -> dict:
        return {"schema": SCHEMA, "flashmemory_version": __version__, "platform": self.platform,
                "settings": self.settings, "checks": [asdict(c) for c in self.checks], "counts": self.counts,
                "ok": self.ok}

    def text(self) -> str:
        lines = []
        for c in self.checks:
            lines.append(f"{c.status.upper():4s}  {c.name:22s} {c.summary}")
            if c.fix:
                lines.append(f"{'':28s} fix: {c.fix}")
        n = self.counts
        lines.append(f"{n['pass']} passed, {n['warn']} warnings, {n['fail']} failed, {n['n/a']} not applicable")
        return "\n".join(lines)


def _platform() -> dict:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"system": platform.system(), "release": platform.release(), "machine": platform.machine(),
            "cpus_available": cpus, "python": platform.python_version()}


def run_doctor(cfg: EngineConfig | None = None, disk_seconds: float = 1.0,
               progress: Callable[[str], None] | None = None) -> DoctorReport:
    """Run every check against the settings in `cfg` (cold_zone_dir, cpu_memory_gb, cold_zone_gb, ...)."""
    cfg = cfg or EngineConfig()
    steps: list[tuple[str, Callable[[], Check]]] = [
        ("python", checks.check_python),
        ("torch", checks.check_torch),
        ("c_compiler", checks.check_compiler),
        ("native_kernels", checks.check_native_kernels),
        ("ram", lambda: checks.check_ram(cfg)),
        ("swap", checks.check_swap),
        ("memlock", lambda: checks.check_memlock(cfg)),
        ("numa", checks.check_numa),
        ("cold_zone_disk", lambda: checks.check_free_disk(cfg)),
        ("cold_zone_iops", lambda: checks.check_disk_speed(cfg, disk_seconds)),
        ("cuda", checks.check_cuda),
        ("cuda_weights", checks.check_cuda_weights),
        ("pinned_memory", checks.check_pinned_memory),
        ("windows_driver_model", checks.check_driver_model),
        ("default_model", checks.check_default_model),
    ]
    results = []
    for name, run in steps:
        if progress is not None:
            progress(name)
        try:
            results.append(run())
        except Exception as e:  # noqa: BLE001 - a broken check is reported, the others still run
            results.append(Check(name, "fail", f"the check itself failed: {type(e).__name__}: {e}",
                                 "report this with `flashmemory doctor --json`"))
    settings = {"cold_zone_enabled": cfg.cold_zone_enabled, "cold_zone_dir": cfg.cold_zone_dir,
                "cpu_memory_gb": cfg.cpu_memory_gb, "cold_zone_gb": cfg.cold_zone_gb}
    return DoctorReport(results, settings, _platform())
