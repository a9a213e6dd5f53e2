"""The native kernels of csrc/ (decode attention, the heat predictor's MLP and its per-step statistics):
compiled once per machine with the system C compiler into one library, loaded through ctypes, and optional —
without a compiler (or with FLASHMEMORY_NATIVE=0) the pure-torch paths run.

The decode kernel reads INT4 / INT2 / FP16 block records straight from the KV pools and folds them into an online-softmax
state, so a decode step never writes a float copy of the quantized window (the torch path's main cost on a CPU).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

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


@dataclass(frozen=True)
class RecordFormat:
    """Where a pool's block record keeps its parts (byte offsets) and how they are coded."""

    bits: int
    block_size: int
    key_group_tokens: int
    value_group_channels: int
    codes_offset: int  # "codes" (INT) or "kv" (FP16)
    k_scale_offset: int = 0
    k_zero_offset: int = 0
    v_scale_offset: int = 0
    v_zero_offset: int = 0


class DecodeState:
    """Online-softmax state of one decode query over any number of key sets: [heads, group, head_dim + 2]."""

    def __init__(self, lib: ctypes.CDLL, q: torch.Tensor, num_kv_heads: int) -> None:
        # q: [num_heads, head_dim] float32 on the CPU (one token)
        num_heads, head_dim = q.shape
        self.lib = lib
        self.heads, self.group, self.dim = num_kv_heads, num_heads // num_kv_heads, head_dim
        self.q = (q * head_dim**-0.5).contiguous()
        self.state = torch.zeros((num_kv_heads, self.group, head_dim + 2), dtype=torch.float32)
        self.state[..., head_dim] = torch.finfo(torch.float32).min  # finite: the kernel is built with -ffast-math

    def add_records(self, storage: torch.Tensor, slots: torch.Tensor, fmt: RecordFormat) -> None:
        """Fold blocks of one layer's pool storage [heads, num_slots, record_bytes]; slots [heads, n] int64."""
        slots = slots.contiguous()
        assert storage.is_contiguous() and slots.dtype == torch.int64 and slots.shape[0] == self.heads
        rc = self.lib.fm_attend_records(
            self.q.data_ptr(), self.heads, self.group, self.dim, storage.data_ptr(), storage.shape[1],
            storage.shape[2], slots.data_ptr(), slots.shape[1], fmt.bits, fmt.block_size, fmt.key_group_tokens,
            fmt.value_group_channels, fmt.codes_offset, fmt.k_scale_offset, fmt.k_zero_offset, fmt.v_scale_offset,
            fmt.v_zero_offset, self.state.data_ptr())
        if rc != 0:
            raise ValueError(f"block format {fmt} is outside the decode kernel's limits")

    def add_dense(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Fold float keys and values [heads, m, head_dim]."""
        k = k.to(torch.float32).contiguous()
        v = v.to(torch.float32).contiguous()
        if k.shape[1]:
            rc = self.lib.fm_attend_dense(self.q.data_ptr(), self.heads, self.group, self.dim, k.data_ptr(),
                                          v.data_ptr(), k.shape[1], self.state.data_ptr())
            if rc != 0:
                raise ValueError(f"head_dim {self.dim} / group {self.group} are outside the decode kernel's limits")

    def output(self) -> torch.Tensor:
        """[num_heads, head_dim]: the attention over everything folded in."""
        d = self.dim
        return (self.state[..., :d] / self.state[..., d + 1 :]).reshape(self.heads * self.group, d)


def supports(block_size: int, head_dim: int, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether decode steps of this geometry can use the kernel (CPU, float32 compute, within its limits; the
    query group is checked per call, `MAX_GROUP`)."""
    return (device.type == "cpu" and dtype == torch.float32 and block_size <= MAX_BLOCK_TOKENS
            and head_dim <= MAX_HEAD_DIM and head_dim % 8 == 0 and library() is not None)
