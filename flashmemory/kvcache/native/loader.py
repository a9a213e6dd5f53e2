"""The loader of the native kernels in csrc/: compiled once per machine with the system C compiler into one
library (cached by source, flags, compiler and CPU), loaded through ctypes; None where it cannot be built."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name("csrc") / name
                for name in ("decode_attention.c", "heat_mlp.c", "access_stats.c"))
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-shared", "-fPIC", "-std=c11")
MAX_BLOCK_TOKENS = 64  # FM_MAX_TOKENS in the C source
MAX_HEAD_DIM = 256  # FM_MAX_DIM
MAX_GROUP = 32  # FM_MAX_GROUP: query heads per KV head
MLP_MAX_HIDDEN = 64  # FM_MLP_MAX_HIDDEN in heat_mlp.c (hidden sizes must be multiples of 8)
MLP_MAX_FEATURES = 64  # FM_MLP_MAX_FEATURES

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


def _cache_dir() -> Path:
    root = os.environ.get("FLASHMEMORY_CACHE_DIR") or Path.home() / ".cache" / "flashmemory"
    return Path(root) / "native"


def _cpu_fingerprint() -> str:
    """What -march=native depends on: a library built on one CPU is never loaded on another."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compile(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run([compiler, *FLAGS, "-o", str(built), *map(str, SOURCES), "-lm"], check=True, capture_output=True,
                       text=True, timeout=120)
        os.replace(built, target)  # atomic: concurrent processes never load a half-written library


@cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (with one log line saying why) when it cannot be used here."""
    if os.environ.get("FLASHMEMORY_NATIVE", "1").lower() in ("0", "false", "no", "off"):
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.info("no C compiler found: decode attention and the heat predictor use the pure-torch paths "
                 "(slower on CPU)")
        return None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
        key = hashlib.sha256(
            b"".join(s.read_bytes() for s in SOURCES) + " ".join(FLAGS).encode() + version.encode()
            + _cpu_fingerprint().encode()
        ).hexdigest()[:16]
        target = _cache_dir() / f"flashmemory_native-{key}.so"
        if not target.is_file():
            _compile(compiler, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        log.warning("could not build the native kernels (%s); using the pure-torch paths", detail.strip()[:500])
        return None
    lib.fm_attend_records.restype = ctypes.c_int
    lib.fm_attend_records.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64, ctypes.c_int, _I64, _I64,
                                      _I64, _I64, _I64, _I64, _I64, _I64, _PTR]
    lib.fm_attend_dense.restype = ctypes.c_int
    lib.fm_attend_dense.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _PTR]
    lib.fm_access_update.restype = ctypes.c_int
    lib.fm_access_update.argtypes = [_I64] * 6 + [_PTR, _I64] + [_PTR] * 9
    lib.fm_access_features.restype = ctypes.c_int
    lib.fm_access_features.argtypes = [_I64] * 6 + [_PTR, _I64, _PTR, _PTR, _I64, _I64] + [_PTR] * 8
    lib.fm_heat_rank.restype = ctypes.c_int
    f32 = ctypes.c_float
    lib.fm_heat_rank.argtypes = [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, f32, _I64, _I64, f32, _I64, f32, _I64,
                                 _I64, f32, _PTR]
    return lib
