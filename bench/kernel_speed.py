"""The native kernels alone: the decode GEMV over block-format weights (GEMV_SHAPES) with float32
and with 8-bit x, 1 and 5 rows, at 1 and 2 threads, medians of interleaved batches; and decode
attention over an 8K-shaped read at
SmolLM2's geometry (3 KV heads of 64, 3 query heads each, 16-token blocks): per layer 128 INT4 blocks (the 2,048-token
window), 120 FP16 and 30 INT2 blocks per KV head plus 8 filling fp16 rows, for all 30 layers of a step (so the
records come from memory, not a warm cache), min and median over many steps at 1 and 2 threads.

With --baseline CHECKOUT, that checkout's decode_attention.c is built into its own library and timed in the same
run, its steps interleaved with this tree's (the machine's load hits both alike):

    PYTHONPATH=. .venv/bin/python bench/kernel_speed.py --attention-only --baseline ../main
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch

from flashmemory.kvcache import native
from flashmemory.kvcache.levels.tensor_pool import TensorPool
from flashmemory.kvcache.manager.blocks import Level
from flashmemory.kvcache.native.loader import FLAGS, declare_decode_attention
from flashmemory.kvcache.quant import Codec
from flashmemory.model.gguf_dequant import FLOAT16_DTYPES
from flashmemory.model.native.quant_kernels import (TYPE_IDS, library, qgemv, qgemv_x8, quantize_x8,
                                                    x8_bytes, x8_layouts)
from flashmemory.native_build import build_library

LAYERS, HEADS, GROUP, BLOCK, DIM = 30, 3, 3, 16, 64
READ_BLOCKS = {4: 128, 16: 120, 2: 30}  # bits -> blocks read per layer and KV head at 8K context
FILLING_ROWS = 8


def median_s(fn: Callable[[], None], n: int = 200) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _blocks(rng: np.random.Generator, type_name: str, rows: int, cols: int) -> torch.Tensor:
    """Encoded rows: gguf's quantizer where it writes the format, else random codes with small
    fp16 scales."""
    if type_name in FLOAT16_DTYPES:  # 16-bit values as their bytes
        values = torch.from_numpy(rng.standard_normal((rows, cols)).astype(np.float32))
        return values.to(FLOAT16_DTYPES[type_name]).view(torch.uint8).contiguous()
    qtype = gguf.GGMLQuantizationType[type_name]
    if not type_name.endswith("_K") and not type_name.startswith("IQ"):
        raw = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
        return torch.from_numpy(np.ascontiguousarray(raw))
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block_elems, block_bytes), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes() * 2, dtype=np.uint8)
    if type_name in ("Q4_K", "Q5_K"):  # d and dmin first
        raw[..., 0:4] = scale
    elif type_name == "Q2_K":  # d and dmin last
        raw[..., -4:] = scale
    elif type_name in ("Q3_K", "Q6_K"):  # d last
        raw[..., -2:] = scale[:2]
    else:  # IQ4: d first
        raw[..., 0:2] = scale[:2]
    return torch.from_numpy(raw.reshape(rows, -1))


# (format, rows, cols): SmolLM2's Q4_1 gate_up and down and Q8_0 LM head, the Qwen2.5-Coder
# models' Q5_0 gate, Q4_K and Q6_K ffn_down (0.5B shapes), and Q5_K / IQ4_XS / Q2_K / Q3_K
# (Q5_K_M, IQ4_XS, Q2_K, Q3_K_M files) at that shape; F16 / BF16 (float x only) against torch's
# float32 GEMV over the same values dequantized (what loading them as float32 gave before)
GEMV_SHAPES = [("Q4_1", 3072, 576), ("Q4_1", 576, 1536), ("Q8_0", 49152, 576), ("Q5_0", 4864, 896),
               ("Q4_K", 896, 4864), ("Q5_K", 896, 4864), ("Q6_K", 896, 4864), ("IQ4_XS", 896, 4864),
               ("Q2_K", 896, 4864), ("Q3_K", 896, 4864), ("F16", 896, 4864), ("BF16", 896, 4864)]


def gemv(rng: np.random.Generator) -> None:
    """Each shape with float32 x (quant_gemv.c) and with x rounded to 8 bits (q8_gemv.c, the
    rounding
    included), 1 and 5 rows of x (a decode step, a 4-token speculative verification), the two paths'
    calls interleaved so the machine's load falls on both alike."""
    lib = library()
    for type_name, rows, cols in GEMV_SHAPES:
        blocks = _blocks(rng, type_name, rows, cols)
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for num_x in (1, 5):
                x, y = torch.randn(num_x, cols), torch.empty(num_x, rows)
                xq = torch.empty(x8_bytes(lib, num_x, cols), dtype=torch.uint8)
                layouts = x8_layouts(lib, [TYPE_IDS[type_name]])

                def float_path() -> None:
                    qgemv(lib, type_name, blocks, cols, x, y)

                if type_name in FLOAT16_DTYPES:
                    dense = blocks.view(FLOAT16_DTYPES[type_name]).float()

                    def int8_path() -> None:  # the float32 GEMV it replaces (no 8-bit path)
                        torch.nn.functional.linear(x, dense, out=y)
                else:
                    def int8_path() -> None:
                        quantize_x8(lib, x, xq, layouts)
                        qgemv_x8(lib, type_name, blocks, cols, xq, num_x, y)

                f32, i8 = [], []
                for _ in range(5):
                    f32.append(median_s(float_path, 40))
                    i8.append(median_s(int8_path, 40))
                f, q = statistics.median(f32), statistics.median(i8)
                gb = blocks.numel() / 1e9
                other = (f"torch's float32 GEMV {q * 1e6:.0f} us: ours {q / f:.2f}x as fast"
                         if type_name in FLOAT16_DTYPES
                         else f"int8 x {q * 1e6:.0f} us ({gb / q:.1f} GB/s): {f / q:.2f}x")
                print(f"GEMV {type_name} {rows} x {cols}, {num_x} row(s), {threads} thread(s): "
                      f"float32 x {f * 1e6:.0f} us ({gb / f:.1f} GB/s of blocks), {other}")


class StepRead:
    """The records one decode step reads: a pool per format holding every layer's blocks, and each pool's slots."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.reads: list[tuple[TensorPool, torch.Tensor, native.RecordFormat]] = []
        for bits, n in READ_BLOCKS.items():
            codec = Codec(bits, BLOCK, 32)
            pool = TensorPool(Level.DEVICE, codec, n, LAYERS, HEADS, BLOCK, DIM, torch.device("cpu"))
            for slot in range(n):
                k = torch.randn(LAYERS, HEADS, BLOCK, DIM) * 2 + 0.5
                pool.put(slot, codec.encode(k, torch.randn(LAYERS, HEADS, BLOCK, DIM)))
            # the INT4 window: one row of slots for every head; the others: each head its own order
            slots = (torch.arange(n).expand(HEADS, -1) if bits == 4
                     else torch.stack([torch.randperm(n) for _ in range(HEADS)]))
            self.reads.append((pool, slots, native.RecordFormat.for_pool(pool)))
        self.filling = torch.randn(2, LAYERS, HEADS, FILLING_ROWS, DIM).half()
        self.q = torch.randn(HEADS * GROUP, DIM)

    def step(self, lib: ctypes.CDLL, state: native.DecodeState) -> torch.Tensor:
        """Every layer's attention with library `lib` (state: a DecodeState of that library); the last output."""
        for layer in range(LAYERS):
            state.reset(self.q)
            state.add_dense(self.filling[0, layer], self.filling[1, layer])
            for pool, slots, fmt in self.reads:
                state.add_records(pool.storage, slots, fmt, layer=layer)
        return state.output()


def baseline_library(checkout: Path) -> ctypes.CDLL:
    source = checkout / "flashmemory/kvcache/native/csrc/decode_attention.c"
    lib = build_library("flashmemory_decode_baseline", [source], FLAGS, f"the baseline at {checkout}")
    if lib is None:
        raise SystemExit(f"could not build {source}")
    return declare_decode_attention(lib)


def attention(baseline: Path | None, steps: int) -> None:
    read = StepRead()
    libs = {"new": native.library()}
    if baseline is not None:
        libs = {"old": baseline_library(baseline), **libs}
    states = {name: native.DecodeState(lib, read.q, HEADS) for name, lib in libs.items()}
    outputs = {name: read.step(lib, states[name]) for name, lib in libs.items()}
    if "old" in outputs:
        diff = ((outputs["new"] - outputs["old"]).abs().max() / outputs["old"].abs().max()).item()
        print(f"max |new - old| / max |old| over the last layer's output: {diff:.1e}")
    blocks = " + ".join(f"{n} {'FP16' if b == 16 else f'INT{b}'}" for b, n in READ_BLOCKS.items())
    print(f"decode attention, {LAYERS} layers x {HEADS} KV heads x ({blocks} blocks of {BLOCK} + {FILLING_ROWS} rows)"
          f", {GROUP} query heads each; {steps} steps per library and thread count, interleaved")
    print("| kernel | threads | ms per step min | median | ms per layer min | median |")
    print("|---|---|---|---|---|---|")
    for threads in (1, 2):
        torch.set_num_threads(threads)
        times: dict[str, list[float]] = {name: [] for name in libs}
        for _ in range(steps):
            for name, lib in libs.items():
                t0 = time.perf_counter()
                read.step(lib, states[name])
                times[name].append(time.perf_counter() - t0)
        for name, ts in times.items():
            lo, mid = min(ts) * 1e3, statistics.median(ts) * 1e3
            print(f"| {name} | {threads} | {lo:.1f} | {mid:.1f} | {lo / LAYERS:.3f} | {mid / LAYERS:.3f} |")
    print(f"load average {os.getloadavg()}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", type=Path, default=None, help="a checkout whose decode attention to compare with")
    p.add_argument("--attention-only", action="store_true", help="skip the GEMV timings")
    p.add_argument("--gemv-only", action="store_true", help="skip the attention timings")
    p.add_argument("--steps", type=int, default=40, help="timed 30-layer steps per library and thread count")
    args = p.parse_args()
    print(f"load average {os.getloadavg()}")
    if not args.attention_only:
        gemv(np.random.default_rng(0))
    if not args.gemv_only:
        attention(args.baseline, args.steps)


if __name__ == "__main__":
    main()
