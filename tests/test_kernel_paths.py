"""The native kernels by CPU path (native_build.KERNEL_PATHS): every path this CPU runs builds, says
which instruction sets it uses, and computes what the native build computes, for every block format
on the float and the 8-bit GEMV; FLASHMEMORY_CPU_KERNELS picks one and refuses one the CPU lacks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashmemory.errors import ConfigError
from flashmemory.kvcache.native import loader as kv_loader
from flashmemory.model.native import quant_kernels
from flashmemory.model.quantized import BLOCK_FORMATS, X8_FORMATS
from flashmemory.native_build import (KERNEL_PATH_ENV, build_library, kernel_path,
                                      runnable_kernel_paths)
from tests.model.test_quantized_weights import _random_blocks

NATIVE = quant_kernels.library("native")
pytestmark = pytest.mark.skipif(NATIVE is None, reason="no C compiler: no native kernels")
LOWER = [p for p in runnable_kernel_paths() if p != "native"]
ISA = {"portable": 0, "avx2": 1}


def _float_gemv(lib, type_name, blocks, cols, x):
    out = torch.empty(x.shape[0], blocks.shape[0])
    quant_kernels.qgemv(lib, type_name, blocks, cols, x, out)
    return out


def _int8_gemv(lib, type_name, blocks, cols, x):
    xq = torch.empty(quant_kernels.x8_bytes(lib, x.shape[0], cols), dtype=torch.uint8)
    quant_kernels.quantize_x8(lib, x, xq)
    out = torch.empty(x.shape[0], blocks.shape[0])
    quant_kernels.qgemv_x8(lib, type_name, blocks, cols, xq, x.shape[0], out)
    return out


@pytest.mark.parametrize("path", LOWER)
def test_a_lower_path_builds_and_names_its_instruction_sets(path):
    lib = quant_kernels.library(path)
    assert lib is not None and lib.fm_kernel_isa() == ISA[path]
    assert lib.fm_x8_vectorized() == (path != "portable")
    assert build_library("flashmemory_native", kv_loader.SOURCES, kv_loader.FLAGS, "the KV kernels",
                         kv_loader.HEADERS, path) is not None


@pytest.mark.parametrize("num_x", [1, 3])
@pytest.mark.parametrize("type_name", list(BLOCK_FORMATS))
@pytest.mark.parametrize("path", LOWER)
def test_every_path_computes_the_native_products(path, type_name, num_x):
    lib = quant_kernels.library(path)
    rows, cols = 40, 512
    raw = _random_blocks(type_name, rows, cols, seed=num_x)
    blocks = torch.from_numpy(np.ascontiguousarray(raw))
    x = torch.randn(num_x, cols, generator=torch.Generator().manual_seed(7))
    for gemv in (_float_gemv, _int8_gemv) if type_name in X8_FORMATS else (_float_gemv,):
        want = gemv(NATIVE, type_name, blocks, cols, x)
        scale = want.abs().max().item()
        torch.testing.assert_close(gemv(lib, type_name, blocks, cols, x), want, rtol=1e-4,
                                   atol=1e-5 * scale)


def test_the_variable_picks_a_path_and_refuses_what_the_cpu_lacks(monkeypatch):
    monkeypatch.delenv(KERNEL_PATH_ENV, raising=False)
    assert kernel_path() == "native"
    monkeypatch.setenv(KERNEL_PATH_ENV, "portable")
    assert kernel_path() == "portable"
    monkeypatch.setenv(KERNEL_PATH_ENV, "avx1024")
    with pytest.raises(ConfigError, match="native, avx2, portable"):
        kernel_path()
    if "avx2" not in runnable_kernel_paths():
        monkeypatch.setenv(KERNEL_PATH_ENV, "avx2")
        with pytest.raises(ConfigError, match="cannot run"):
            kernel_path()
