"""The loader of the native kernels in csrc/: compiled once per machine with the system C compiler into one
library (cached by source, flags, compiler and CPU), loaded through ctypes; None where it cannot be built."""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

from flashmemory.native_build import BASE_FLAGS, build_library

SOURCES = tuple(Path(__file__).with_name("csrc") / name
                for name in ("decode_attention.c", "decode_batch.c", "quest_select.c",
                             "heat_mlp.c", "access_stats.c", "quant_range.c", "segment_read.c",
                             "block_rescore.c"))
HEADERS = (Path(__file__).with_name("csrc") / "decode_attention.h",)  # in the build's cache key
# -fopenmp: decode attention splits its blocks over torch's OpenMP threads (the same libgomp, loaded by torch first).
FLAGS = (*BASE_FLAGS, "-fopenmp")
MAX_BLOCK_TOKENS = 64  # FM_MAX_TOKENS in the C source
MAX_HEAD_DIM = 256  # FM_MAX_DIM
MAX_GROUP = 32  # FM_MAX_GROUP: query heads per KV head
MLP_MAX_HIDDEN = 64  # FM_MLP_MAX_HIDDEN in heat_mlp.c (hidden sizes must be multiples of 8)
MLP_MAX_FEATURES = 64  # FM_MLP_MAX_FEATURES
MAX_RANGE_FACTORS = 16  # FM_RANGE_MAX_FACTORS in quant_range.c
MAX_DIGEST_BOXES = 16  # FM_SELECT_MAX_BOXES in quest_select.c

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


@cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (with one log line saying why) when it cannot be used here."""
    what = "decode attention and the heat predictor"
    lib = build_library("flashmemory_native", SOURCES, FLAGS, what, HEADERS)
    if lib is None:
        return None
    declare_decode_attention(lib)
    lib.fm_quest_select.restype = ctypes.c_int
    lib.fm_quest_select.argtypes = [_PTR, _I64, _I64, _I64, _PTR, ctypes.c_int, _I64, _I64, _I64, _I64, _PTR, _PTR,
                                    _I64, _I64, _PTR, _PTR]
    lib.fm_rescore_blocks.restype = ctypes.c_int
    lib.fm_rescore_blocks.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _I64, _PTR, _I64,
                                      _I64, ctypes.c_float, _PTR, ctypes.c_int]
    lib.fm_access_update.restype = ctypes.c_int
    lib.fm_access_update.argtypes = [_I64] * 6 + [_PTR, _I64] + [_PTR] * 9
    lib.fm_access_features.restype = ctypes.c_int
    lib.fm_access_features.argtypes = [_I64] * 6 + [_PTR, _I64, _PTR, _PTR, _I64, _I64] + [_PTR] * 8
    lib.fm_heat_rank.restype = ctypes.c_int
    f32 = ctypes.c_float
    lib.fm_heat_rank.argtypes = [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, f32, _I64, _I64, f32, _I64, f32, _I64,
                                 _I64, f32, _PTR]
    lib.fm_quant_range.restype = ctypes.c_int
    lib.fm_quant_range.argtypes = [_PTR, _I64, _I64, _I64, ctypes.c_int, _PTR, ctypes.c_int, _PTR, _PTR]
    lib.fm_read_segments.restype = _I64
    lib.fm_read_segments.argtypes = [ctypes.c_int, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _PTR]
    lib.fm_crc32.restype = ctypes.c_uint32
    lib.fm_crc32.argtypes = [_PTR, _I64]
    return lib


def declare_decode_attention(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Give decode_attention.c's entry points their ctypes signatures (also used by bench/kernel_speed.py on a
    library built from another checkout's decode_attention.c, for an old-versus-new comparison)."""
    lib.fm_attend_records.restype = ctypes.c_int
    lib.fm_attend_records.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64, _PTR, _I64, ctypes.c_int,
                                      _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _PTR, ctypes.c_int]
    lib.fm_attend_dense.restype = ctypes.c_int
    lib.fm_attend_dense.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _PTR]
    lib.fm_attend_dense_f16.restype = ctypes.c_int
    lib.fm_attend_dense_f16.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR]
    lib.fm_decode_begin.restype = None
    lib.fm_decode_begin.argtypes = [_PTR, ctypes.c_float, _I64, _I64, _PTR, _PTR]
    lib.fm_decode_end.restype = None
    lib.fm_decode_end.argtypes = [_PTR, _I64, _I64, _PTR]
    if hasattr(lib, "fm_attend_batch"):  # none in an older checkout's (bench/kernel_speed.py)
        lib.fm_attend_batch.restype = ctypes.c_int
        lib.fm_attend_batch.argtypes = [_PTR, ctypes.c_float, _I64, _I64, _I64, _I64, _PTR, _PTR,
                                        ctypes.c_int, _PTR]
    return lib
