"""Benchmark: FlashMemory's runner vs Hugging Face transformers' `generate` on the same weights.

Kept for the commands in older notes; the benchmark itself is `flashmemory bench` (flashmemory/tools/bench/), which
this script calls with the two engines it used to compare:

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/bench_runner.py --lengths 512 2048 --runs 3 [--dtype bfloat16]

is `flashmemory bench --engines fm-contiguous hf-dynamic --fidelity-tokens 0 --decode-tokens 32 ...`: our exact
contiguous cache in the model dtype against transformers' DynamicCache, each measurement in its own process,
interleaved, medians. `--kv-cache tiered` compares FlashMemory's default tiered cache (fm-mixed) instead.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashmemory.cli import main as flashmemory_main  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF or HF folder (default: embedded SmolLM2)")
    ap.add_argument("--text", default=None)
    ap.add_argument("--lengths", nargs="+", default=["512", "2048"])
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--kv-cache", default="contiguous", choices=["contiguous", "tiered"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    ours = "fm-contiguous" if args.kv_cache == "contiguous" else "fm-mixed"
    argv = ["bench", "--engines", ours, "hf-dynamic", "--fidelity-tokens", "0", "--no-limit-run",
            "--decode-tokens", str(args.decode_tokens), "--runs", str(args.runs), "--dtype", args.dtype,
            "--lengths", *args.lengths]
    for flag, value in (("--model", args.model), ("--text", args.text), ("--json", args.json)):
        if value:
            argv += [flag, value]
    return flashmemory_main(argv)


if __name__ == "__main__":
    sys.exit(main())
