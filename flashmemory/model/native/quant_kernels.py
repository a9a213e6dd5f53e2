"""ctypes binding of the model's native library: csrc/quant_gemv.c (the decode GEMV over quantized weight rows, row
dequantization), csrc/q8_gemv.c (the same GEMV with x rounded to 8 bits, integer dots) and
csrc/step_ops.c (fused RMSNorm, RoPE and SwiGLU, used by step_ops.py)."""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from flashmemory.config import RunSettings
from flashmemory.model.quantized import X8_FORMATS
from flashmemory.native_build import BASE_FLAGS, build_library
from flashmemory.settings import setting_of

SOURCES = tuple(Path(__file__).with_name("csrc") / name
                for name in ("quant_gemv.c", "q8_gemv.c", "step_ops.c", "projection.c",
                             "decode_layer.c"))
HEADERS = tuple(Path(__file__).with_name("csrc") / name  # in the build's cache key
                for name in ("block_formats.h", "projection.h", "row_chunks.h"))
# -fopenmp: the output rows are split over torch's OpenMP threads (the same libgomp, loaded by torch first).
# -fno-associative-math: every product and sum in the order written, so the inlined copies of one
# kernel (q8_gemv.c's one-row copy keeps its accumulators in registers) compute the same bits: row r
# of a several-row GEMV is the one-row GEMV's, as a speculative verification needs.
FLAGS = (*BASE_FLAGS, "-fopenmp", "-fno-associative-math")
MAX_X_ROWS = 8  # FM_MAX_X: rows of x one GEMV call takes
# GGUF type ids of the block formats the kernels read (the file format's numbering).
TYPE_IDS = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11,
            "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "IQ4_NL": 20, "IQ4_XS": 23, "F16": 1, "BF16": 30}

# EngineConfig.decode_activations (its choices declared there): how the decode GEMV multiplies x.
DECODE_ACTIVATIONS = setting_of(RunSettings, "decode_activations").choices

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


# fm_kernel_isa's answers: the instruction sets a build's kernels use.
KERNEL_ISAS = {0: "portable C", 1: "AVX2 + FMA", 2: "AVX-512 (+ VNNI where present)"}


@cache
def library(path: str | None = None) -> ctypes.CDLL | None:
    """The model's kernels built for `path` (native_build.KERNEL_PATHS; None: the one
    FLASHMEMORY_CPU_KERNELS names, else every instruction set this CPU has)."""
    lib = build_library("flashmemory_model", SOURCES, FLAGS, "quantized weights and the fused step operations",
                        HEADERS, path)
    if lib is None:
        return None
    lib.fm_kernel_isa.restype = _INT
    lib.fm_qgemv.restype = _INT
    lib.fm_qgemv.argtypes = [_INT, _PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64, _INT]
    lib.fm_dequant_rows.restype = _INT
    lib.fm_dequant_rows.argtypes = [_INT, _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _INT]
    lib.fm_quantize_x8.restype = None
    lib.fm_quantize_x8.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _INT]
    lib.fm_qgemv_x8.restype = _INT
    lib.fm_qgemv_x8.argtypes = [_INT, _PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _I64, _INT]
    lib.fm_round_x8.restype = None
    lib.fm_round_x8.argtypes = [_PTR, _I64, _I64, _I64, _INT]
    lib.fm_x8_bytes.restype = _I64
    lib.fm_x8_bytes.argtypes = [_I64, _I64]
    lib.fm_x8_layout.restype = _INT
    lib.fm_x8_layout.argtypes = [_INT]
    lib.fm_x8_vectorized.restype = _INT
    lib.fm_rmsnorm.restype = None
    lib.fm_rmsnorm.argtypes = [_PTR, _I64, _PTR, _I64, _I64, ctypes.c_float, _PTR]
    lib.fm_rope.restype = None
    lib.fm_rope.argtypes = [_PTR, _I64, _I64, _I64, _I64, _PTR, _PTR]
    lib.fm_swiglu.restype = None
    lib.fm_swiglu.argtypes = [_PTR, _I64, _I64, _PTR]
    return lib


def qgemv(lib: ctypes.CDLL, type_name: str, blocks: torch.Tensor, cols: int, x: torch.Tensor,
          out: torch.Tensor) -> None:
    """out [n, rows] = x [n, cols] @ W.T for W's blocks [rows, row_bytes] uint8; n <= MAX_X_ROWS, float32,
    rows of x and out contiguous."""
    rc = lib.fm_qgemv(TYPE_IDS[type_name], blocks.data_ptr(), blocks.shape[0], cols, blocks.shape[1], x.data_ptr(),
                      x.shape[0], x.stride(0), out.data_ptr(), out.stride(0), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"fm_qgemv refused a {type_name} weight of {blocks.shape[0]} x {cols} (code {rc})")


def dequant_rows(lib: ctypes.CDLL, type_name: str, blocks: torch.Tensor, cols: int, out: torch.Tensor,
                 first_row: int = 0, row_ids: torch.Tensor | None = None) -> None:
    """out [n, cols] float32 = the dequantized rows row_ids (int64), or rows first_row .. first_row + n."""
    ids = None if row_ids is None else row_ids.data_ptr()
    rc = lib.fm_dequant_rows(TYPE_IDS[type_name], blocks.data_ptr(), cols, blocks.shape[1], ids, first_row,
                             out.shape[0], out.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"fm_dequant_rows refused a {type_name} weight of {cols} columns (code {rc})")


# The formats whose float path has a one-row vector kernel (quant_gemv.c's `one_row`): there
# int8 x gains 1.1-1.3x and costs fidelity the smallest models feel (SmolLM2 flips its first token
# on the README's own prompt), so "auto" keeps float x for them. The others (the K-quants, Q5_1,
# IQ4) dequantize each block before the dot and gain 2.4-7x from int8 x.
FLOAT_ONE_ROW_FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "F16", "BF16")


def resolve_decode_activations(requested: str, lib: ctypes.CDLL | None) -> str:
    """"int8", "float32" or "auto" (int8 for the formats outside FLOAT_ONE_ROW_FORMATS): what the
    decode GEMV does for `requested` (DECODE_ACTIVATIONS). "auto" resolves to float32 where the
    8-bit kernel is not vectorized for this CPU (no AVX2: its portable C is slower than the float
    path's), and everything to float32 without the native library."""
    if requested not in DECODE_ACTIVATIONS:
        raise ValueError(f"decode_activations={requested!r}: use one of "
                         f"{', '.join(DECODE_ACTIVATIONS)}")
    if lib is None or requested == "auto" and not lib.fm_x8_vectorized():
        return "float32"
    return requested


def int8_for(activations: str, type_name: str) -> bool:
    """Whether a resolved `activations` mode rounds x to 8 bits for weights of `type_name` (never
    for F16 / BF16, which have no 8-bit path)."""
    if type_name not in X8_FORMATS:
        return False
    return activations == "int8" or activations == "auto" and type_name not in FLOAT_ONE_ROW_FORMATS


def int8_for_head(activations: str, type_name: str) -> bool:
    """The LM head's rule: float x where its format has a one-row float dot (Q8_0, Q4_0, ...);
    otherwise as int8_for says: a Q6_K head with float x goes through dequantize-then-dot, 3-4x
    slower (Qwen2.5-Coder-1.5B's 151,936 x 1,536 head was ~95 ms of a 242 ms step)."""
    return type_name not in FLOAT_ONE_ROW_FORMATS and int8_for(activations, type_name)


def x8_layouts(lib: ctypes.CDLL, type_ids: list[int]) -> int:
    """fm_quantize_x8's `layouts` for the 8-bit GEMVs of weights of these formats (GGUF type ids):
    x in blocks of 32 for the 32-weight formats, in super-blocks of 256 for the others."""
    bits = 0
    for type_id in type_ids:
        bits |= lib.fm_x8_layout(type_id)
    return bits


def x8_bytes(lib: ctypes.CDLL, num_x: int, cols: int) -> int:
    """Bytes of num_x rows of cols values quantized by quantize_x8 (cols a multiple of 32)."""
    return lib.fm_x8_bytes(num_x, cols)


def quantize_x8(lib: ctypes.CDLL, x: torch.Tensor, out: torch.Tensor, layouts: int = 3) -> None:
    """x [n, cols] float32 (rows contiguous, cols a multiple of 32) into out (uint8, x8_bytes), in
    the layouts `layouts` names (x8_layouts; 3: both, super-blocks where cols allows)."""
    lib.fm_quantize_x8(x.data_ptr(), x.shape[0], x.stride(0), x.shape[1], out.data_ptr(), layouts)


def round_x8(lib: ctypes.CDLL, x: torch.Tensor) -> None:
    """x [n, cols] float32 (rows contiguous, cols a multiple of 32) rounded in place to what the
    8-bit GEMV sees of it: a GEMM over the rounded rows computes what the GEMV computes."""
    lib.fm_round_x8(x.data_ptr(), x.shape[0], x.stride(0), x.shape[1], torch.get_num_threads())


def qgemv_x8(lib: ctypes.CDLL, type_name: str, blocks: torch.Tensor, cols: int, xq: torch.Tensor,
             num_x: int, out: torch.Tensor) -> None:
    """out [num_x, rows] = x @ W.T from x quantized by quantize_x8 (rows of out contiguous)."""
    rc = lib.fm_qgemv_x8(TYPE_IDS[type_name], blocks.data_ptr(), blocks.shape[0], cols,
                         blocks.shape[1], xq.data_ptr(), num_x, out.data_ptr(), out.stride(0),
                         torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"fm_qgemv_x8 refused a {type_name} weight of {blocks.shape[0]} x {cols} "
                         f"(code {rc})")
