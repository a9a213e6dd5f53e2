"""What this machine's CPU can run, read once from /proc/cpuinfo: its model name and the
instruction-set flags the native kernels are built for (native_build.py) and the benchmark
reports record (with llama.cpp's choice of buffer types, which depends on AMX)."""

from __future__ import annotations

import platform
from functools import cache
from pathlib import Path

# The flags a report names (the rest of the flags line changes nothing we build or choose).
REPORTED_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                  "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16",
                  "neon", "asimd", "asimddp", "sve")


@cache
def _cpuinfo_lines() -> tuple[str, ...]:
    try:
        return tuple(Path("/proc/cpuinfo").read_text().splitlines())
    except OSError:
        return ()


def flags_line() -> str:
    """The first flags line of /proc/cpuinfo as written (x86 "flags", Arm "Features"); the
    machine's processor name where there is none."""
    for line in _cpuinfo_lines():
        if line.startswith(("flags", "Features")):
            return line
    return platform.processor() or platform.machine()


def flags() -> frozenset[str]:
    _, _, values = flags_line().partition(":")
    return frozenset(values.split())


def model_name() -> str:
    for line in _cpuinfo_lines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


def has_amx() -> bool:
    """Intel AMX tiles: llama.cpp's CPU backend then repacks weights for them."""
    return "amx_tile" in flags()


def describe() -> dict[str, object]:
    """The CPU as a report records it: its model and which of REPORTED_FLAGS it has."""
    have = flags()
    return {"model": model_name(), "flags": [f for f in REPORTED_FLAGS if f in have]}
