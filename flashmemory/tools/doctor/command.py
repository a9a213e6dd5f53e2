"""`flashmemory doctor` on the command line: its flags and what running it does."""

from __future__ import annotations

import argparse
import json
import sys

from flashmemory.config import EngineConfig
from flashmemory.config_args import add_flags, engine_kwargs

CHECKED_SETTINGS = ("cpu_memory_gb", "cold_zone_enabled", "cold_zone_dir", "cold_zone_gb")


def add_doctor_command(sub: argparse._SubParsersAction) -> None:
    """Register `flashmemory doctor` on the CLI's subcommands."""
    p = sub.add_parser(
        "doctor", help="check this machine: Python, torch, compiler and kernels, RAM, disk speed, swap, NUMA, GPU",
        description="Check the environment FlashMemory runs in; each check passes, warns or fails with the fix. "
        "The cold zone folder's random-read IOPS and latency are measured with real reads (O_DIRECT or "
        "posix_fadvise, so the page cache does not count). Exit status 1 when a check fails.")
    p.add_argument("--json", action="store_true", help="print the report as JSON (docs/doctor.md)")
    p.add_argument("--disk-seconds", type=float, default=1.0,
                   help="seconds per random-read pass of the disk probe (0 = do not measure the disk)")
    add_flags(p, EngineConfig, CHECKED_SETTINGS, "settings to check against the machine")
    p.set_defaults(func=run_doctor_command)


def run_doctor_command(args: argparse.Namespace) -> int:
    from flashmemory.tools.doctor.report import run_doctor

    cfg = EngineConfig(**{k: v for k, v in engine_kwargs(args).items() if k in CHECKED_SETTINGS})
    progress = None if args.json or not sys.stderr.isatty() else (lambda name: print(f"checking {name} ...",
                                                                                   file=sys.stderr))
    report = run_doctor(cfg, disk_seconds=args.disk_seconds, progress=progress)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.text())
    return 0 if report.ok else 1
