"""Error of the KV codec on real keys and values: every quantized precision and range over a KV snapshot's tokens.

A snapshot (`flashmemory eval --kv-snapshot FILE` writes one) holds a prompt's exact post-RoPE KV; this encodes a
token range of it block by block, as the cache does, and decodes it again. Reported per (bits, range): the key error
relative to the keys' variance within their block (what ranks tokens in attention; a per-block constant would
not) and the value error relative to the values' energy.

    .venv/bin/python bench/codec_error.py ~/.cache/flashmemory/snapshots/lcet10-32k.kvsnap --block-size 32
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from flashmemory.kvcache.config import VALUE_GROUP_CHANNELS
from flashmemory.kvcache.quant import QUANT_RANGES, Codec
from flashmemory.kvcache.snapshot import SnapshotReader, read_header


def codec_errors(keys: torch.Tensor, values: torch.Tensor, codec: Codec, block_size: int) -> tuple[float, float]:
    """keys, values [layers, heads, tokens, D] -> (key error / within-block key variance, value error / energy)."""
    layers, heads, tokens, dim = keys.shape
    k = keys.float().reshape(layers, heads, tokens // block_size, block_size, dim)
    v = values.float().reshape(layers, heads, tokens // block_size, block_size, dim)
    dk, dv = codec.decode(codec.encode(k, v), torch.float32)
    key_var = (k - k.mean(dim=-2, keepdim=True)).square().sum()
    return float((dk - k).square().sum() / key_var), float((dv - v).square().sum() / v.square().sum())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("snapshot", type=Path, help="a KV snapshot file")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block (the cache's block_size)")
    p.add_argument("--start", type=int, default=8192, help="first token of the range")
    p.add_argument("--tokens", type=int, default=4096, help="tokens in the range (a multiple of --block-size)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    header = read_header(args.snapshot)
    num_tokens = header["shape"][2]
    start = min(args.start, max(0, num_tokens - args.tokens))
    end = start + (min(args.tokens, num_tokens - start) // args.block_size) * args.block_size
    if end <= start:
        p.error(f"the snapshot has {num_tokens} tokens: fewer than one block of {args.block_size}")
    with SnapshotReader(args.snapshot, header["fingerprint"], []) as reader:
        keys, values = reader.read(start, end)
    value_group = min(VALUE_GROUP_CHANNELS, keys.shape[-1])
    rows = []
    for bits in (4, 2):
        for quant_range in QUANT_RANGES:
            codec = Codec(bits, args.block_size, value_group, quant_range)
            key_err, value_err = codec_errors(keys, values, codec, args.block_size)
            rows.append({"bits": bits, "range": quant_range, "key_error": key_err, "value_error": value_err})
            print(f"INT{bits} {quant_range:10s} key error {key_err:.4f}  value error {value_err:.4f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"snapshot": str(args.snapshot), "tokens": [start, end],
                                         "block_size": args.block_size, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
