"""Build and load a native library from C sources: compiled once per machine with the system C compiler (cached
by source, flags, compiler and CPU), loaded through ctypes; None where it cannot be built. Shared by the KV
cache's kernels (kvcache/native) and the model's (model/native)."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from flashmemory import cpu_features
from flashmemory.errors import ConfigError

logger = logging.getLogger(__name__)

BASE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-shared", "-fPIC", "-std=c11")

# Which instruction sets the kernels are built for: every one this CPU has ("native", the default),
# or a lower path forced by FLASHMEMORY_CPU_KERNELS (to compare paths, or to rule one out): the
# flags added to -march=native that take the rest away. Each path is its own cached library.
KERNEL_PATH_ENV = "FLASHMEMORY_CPU_KERNELS"
KERNEL_PATHS = {
    "native": (),
    "avx2": ("-mno-avx512f", "-mno-avxvnni"),  # AVX2 + FMA + F16C, no AVX-512 (nor VNNI)
    "portable": ("-mno-avx",),  # no AVX at all: the C paths (the compiler's SSE at most)
}


def runnable_kernel_paths() -> tuple[str, ...]:
    """The kernel paths this CPU can run, lowest first (on a non-x86 CPU only "native")."""
    have = cpu_features.flags()
    if "sse2" not in have:
        return ("native",)
    lower = ("portable", "avx2") if {"avx2", "fma", "f16c"} <= have else ("portable",)
    return (*lower, "native")


def kernel_path() -> str:
    """The path FLASHMEMORY_CPU_KERNELS forces, "native" when unset; a path this CPU cannot run is
    a ConfigError naming the ones it can."""
    path = os.environ.get(KERNEL_PATH_ENV, "native").strip().lower() or "native"
    if path not in KERNEL_PATHS:
        raise ConfigError(f"{KERNEL_PATH_ENV}={path!r} is not one of {', '.join(KERNEL_PATHS)}")
    if path not in runnable_kernel_paths():
        raise ConfigError(f"{KERNEL_PATH_ENV}={path}: this CPU cannot run that path; it runs "
                          f"{', '.join(runnable_kernel_paths())}")
    return path


def native_disabled() -> bool:
    """FLASHMEMORY_NATIVE=0 (or false/no/off) turns every native kernel off: the torch paths run instead."""
    return os.environ.get("FLASHMEMORY_NATIVE", "1").lower() in ("0", "false", "no", "off")


def _cache_dir() -> Path:
    root = os.environ.get("FLASHMEMORY_CACHE_DIR") or Path.home() / ".cache" / "flashmemory"
    return Path(root) / "native"


def _compile(compiler: str, flags: Sequence[str], sources: Sequence[Path], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run([compiler, *flags, "-o", str(built), *map(str, sources), "-lm"], check=True,
                       capture_output=True, text=True, timeout=600)  # minutes on a loaded machine
        os.replace(built, target)  # atomic: concurrent processes never load a half-written library


def build_library(name: str, sources: Sequence[Path], flags: Sequence[str], what: str,
                  headers: Sequence[Path] = (), path: str | None = None) -> ctypes.CDLL | None:
    """The compiled library `name`, or None (with one log line naming `what` falls back) when it
    cannot be used. `headers`: files the sources include (not compiled; in the cache key).
    `path`: the kernel path to build for (KERNEL_PATHS), else kernel_path()'s."""
    if native_disabled():
        return None
    path = kernel_path() if path is None else path
    flags = (*flags, *KERNEL_PATHS[path])
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.info("no C compiler found: %s use the pure-torch paths (slower on CPU)", what)
        return None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
        key = hashlib.sha256(
            b"".join(s.read_bytes() for s in (*sources, *headers)) + " ".join(flags).encode()
            + version.encode()
            + cpu_features.flags_line().encode()  # -march=native: never loaded on another CPU
        ).hexdigest()[:16]
        target = _cache_dir() / f"{name}-{path}-{key}.so"
        if not target.is_file():
            _compile(compiler, flags, sources, target)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        logger.warning(
            "could not build the native kernels of %s (%s); using the pure-torch paths", what,
            detail.strip()[:500])
        return None
