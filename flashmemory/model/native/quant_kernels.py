"""ctypes binding of the model's native library: csrc/quant_gemv.c (the decode GEMV over quantized weight rows, row
dequantization) and csrc/step_ops.c (fused RMSNorm, RoPE and SwiGLU, used by step_ops.py)."""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from flashmemory.native_build import BASE_FLAGS, build_library

SOURCES = tuple(Path(__file__).with_name("csrc") / name for name in ("quant_gemv.c", "step_ops.c"))
# -fopenmp: the output rows are split over torch's OpenMP threads (the same libgomp, loaded by torch first).
FLAGS = (*BASE_FLAGS, "-fopenmp")
MAX_X_ROWS = 8  # FM_MAX_X: rows of x one GEMV call takes
# GGUF type ids of the block formats the kernels read (the file format's numbering).
TYPE_IDS = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


@cache
def library() -> ctypes.CDLL | None:
    lib = build_library("flashmemory_model", SOURCES, FLAGS, "quantized weights and the fused step operations")
    if lib is None:
        return None
    lib.fm_qgemv.restype = _INT
    lib.fm_qgemv.argtypes = [_INT, _PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64, _INT]
    lib.fm_dequant_rows.restype = _INT
    lib.fm_dequant_rows.argtypes = [_INT, _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _INT]
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
