"""What authenticating the persistent cache costs per L2 record: the HMAC-SHA256 a persistent
disk level adds to every block it writes (beside the CRC-32s it already computes), and the
start-up check of a record read back (read, header parse, MAC), for the record sizes of a few
models' geometries (block 16, the default mixed precision: INT2 on L2). No model is loaded; each
figure is the best of --repeats runs of --records records, on one core.

    .venv/bin/python bench/record_mac_cost.py
"""

from __future__ import annotations

import argparse
import tempfile
import time
import zlib
from pathlib import Path

import torch

from flashmemory.kvcache.config import level_codecs
from flashmemory.kvcache.levels.disk_pool import DiskPool
from flashmemory.kvcache.manager.blocks import Level

# name -> (num_layers, num_kv_heads, head_dim)
GEOMETRIES = {"SmolLM2-135M": (30, 3, 64), "Qwen2.5-0.5B": (24, 2, 64), "Llama-3-8B": (32, 8, 128)}


def _best_us(fn, records: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(records):
            fn(i)
        best = min(best, (time.perf_counter() - start) / records)
    return best * 1e6


def measure(layers: int, heads: int, head_dim: int, records: int,
            repeats: int) -> dict[str, float]:
    codec = level_codecs("mixed", 16, head_dim)[Level.DISK]
    with tempfile.TemporaryDirectory() as tmp:
        pool = DiskPool(codec, 64, layers, heads, 16, head_dim, Path(tmp) / "kv", b"model",
                        persistent=True, namespace=b"n" * 32)
        kv = [torch.randn(layers, heads, 16, head_dim) for _ in range(2)]
        parts = codec.encode(*kv)
        segments = [pool._segment(parts, layer) for layer in range(layers)]
        record = pool.shape.pack(1, [zlib.crc32(s) for s in segments]) + b"".join(segments)
        pool.put(0, parts, name=1)
        signer, tag = pool.signer, pool.tag_of(0)
        assert signer is not None and tag is not None

        def verify(_: int) -> None:
            raw = pool.read_record(0)
            assert pool.shape.parse(raw) is not None and signer.record_ok(0, raw, tag)

        out = {"record_bytes": len(record),
               "hmac_us": _best_us(lambda i: signer.record_tag(i, record), records, repeats),
               "crc32_us": _best_us(lambda i: [zlib.crc32(s) for s in segments], records, repeats),
               "startup_verify_us": _best_us(verify, records, repeats)}
        pool.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    print("| model geometry | record bytes | HMAC per write | CRC-32s per write (before) "
          "| start-up check per record |")
    print("|---|---:|---:|---:|---:|")
    for name, (layers, heads, head_dim) in GEOMETRIES.items():
        m = measure(layers, heads, head_dim, args.records, args.repeats)
        print(f"| {name} | {m['record_bytes']:,} | {m['hmac_us']:.0f} us | "
              f"{m['crc32_us']:.0f} us | {m['startup_verify_us']:.0f} us |")


if __name__ == "__main__":
    main()
