"""The native kernels alone, median of 200 calls: the decode GEMV over block-format weights (SmolLM2's Q4_1
gate_up and down, its Q8_0 LM head, a Q5_0 matrix) at 1 and 2 threads, and decode attention over 2K tokens of
INT4 / FP16 block records (3 KV heads of 64, 3 query heads each: SmolLM2's geometry) per layer.

    PYTHONPATH=. .venv/bin/python bench/kernel_speed.py
"""

from __future__ import annotations

import os
import statistics
import time

import gguf
import numpy as np
import torch

from flashmemory.kvcache import native
from flashmemory.kvcache.levels.tensor_pool import TensorPool
from flashmemory.kvcache.manager.blocks import Level
from flashmemory.kvcache.quant import Codec
from flashmemory.model.native.quant_kernels import library, qgemv


def median_s(fn, n: int = 200) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    lib = library()
    rng = np.random.default_rng(0)
    print(f"load average {os.getloadavg()}")
    for type_name, rows, cols in [("Q4_1", 3072, 576), ("Q4_1", 576, 1536), ("Q8_0", 49152, 576), ("Q5_0", 4864, 896)]:
        raw = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32),
                                   gguf.GGMLQuantizationType[type_name])
        blocks = torch.from_numpy(np.ascontiguousarray(raw))
        x, y = torch.randn(1, cols), torch.empty(1, rows)
        for threads in (1, 2):
            torch.set_num_threads(threads)
            s = median_s(lambda: qgemv(lib, type_name, blocks, cols, x, y))
            print(f"GEMV {type_name} {rows} x {cols}, {threads} thread(s): {s * 1e6:.0f} us, "
                  f"{blocks.numel() / s / 1e9:.1f} GB/s of blocks")
    heads, group, block, dim, num_blocks = 3, 3, 16, 64, 128
    for bits in (4, 16):
        codec = Codec(bits, block, 32)
        pool = TensorPool(Level.DEVICE, codec, num_blocks, 1, heads, block, dim, torch.device("cpu"))
        for slot in range(num_blocks):
            pool.put(slot, codec.encode(torch.randn(1, heads, block, dim), torch.randn(1, heads, block, dim)))
        slots = torch.arange(num_blocks).expand(heads, -1).contiguous()
        q, fmt = torch.randn(heads * group, dim), native.RecordFormat.for_pool(pool)

        def attend() -> None:
            state = native.DecodeState(native.library(), q, heads)
            state.add_records(pool.storage[0], slots, fmt)
            state.output()

        for threads in (1, 2):
            torch.set_num_threads(threads)
            s = median_s(attend, 50)
            print(f"attention over {num_blocks * block} tokens of {bits}-bit records, {threads} thread(s): "
                  f"{s * 1e3:.2f} ms per layer, {s / (num_blocks * block * heads * dim * 2) * 1e9:.2f} ns per value")


if __name__ == "__main__":
    main()
