"""Decode speed of KV configurations side by side at a long context: interleaved rounds, medians.

Every configuration gets its own engine (same checkpoint) and one sequence prefilled with the same real text up
to --context tokens; then rounds of --steps teacher-forced decode steps alternate between the configurations
(A B A B ...), so a shared, noisy machine slows all of them alike. Reports the median ms/step per configuration
and its speed relative to the first one (the exact FP16 cache by default).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/decode_speed.py --context 8192 --rounds 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from flashmemory import FlashMemoryEngine
from flashmemory.tools.eval import default_text_path, parse_config

DEFAULT_CONFIGS = ["exact-fp16:kv_cache=contiguous,kv_precision=fp16", "mixed:kv_cache=tiered"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the embedded SmolLM2)")
    p.add_argument("--text", type=Path, default=None, help="long text file (default: ../shared/data/alice29.txt)")
    p.add_argument("--context", type=int, default=8192, help="tokens in context when the last step runs")
    p.add_argument("--steps", type=int, default=16, help="decode steps per round")
    p.add_argument("--rounds", type=int, default=5, help="rounds per configuration (medians over them)")
    p.add_argument("--config", action="append", default=None, metavar="NAME:key=value,...",
                   help=f"a KV configuration (repeatable; default: {' and '.join(DEFAULT_CONFIGS)})")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    text_path = args.text or default_text_path()
    if text_path is None:
        p.error("no --text given and ../shared/data/alice29.txt not found")
    configs = [parse_config(spec) for spec in (args.config or DEFAULT_CONFIGS)]
    decode_total = args.steps * args.rounds

    engines: dict[str, FlashMemoryEngine] = {}
    ids: list[int] = []
    for name, knobs in configs:
        engine = FlashMemoryEngine(args.model, max_seq_len=args.context, **knobs)
        if not ids:
            ids = engine.tokenizer.encode(text_path.read_text(encoding="utf-8", errors="replace"))
            need = args.context - 1
            if len(ids) < need:
                p.error(f"{text_path} has {len(ids)} tokens; --context {args.context} needs {need}")
            ids = ids[:need]
        engine.cache.add_sequence(0)
        t0 = time.perf_counter()
        engine.forward_tokens(0, ids[: len(ids) - decode_total])
        print(f"[{name}] prefilled {len(ids) - decode_total} tokens in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        engines[name] = engine

    per_step: dict[str, list[float]] = {name: [] for name in engines}
    position = len(ids) - decode_total
    for r in range(args.rounds):
        window = ids[position + r * args.steps : position + (r + 1) * args.steps]
        for name, engine in engines.items():
            t0 = time.perf_counter()
            for token in window:
                engine.forward_tokens(0, [token])
            per_step[name].append((time.perf_counter() - t0) / len(window))

    base = statistics.median(per_step[configs[0][0]])
    rows = []
    print(f"\ncontext {args.context} tokens, {args.rounds} interleaved rounds of {args.steps} steps, "
          f"{torch.get_num_threads()} threads\n")
    print("| config | median ms/step | decode tok/s | vs first |")
    print("|---|---:|---:|---:|")
    for name, knobs in configs:
        med = statistics.median(per_step[name])
        rows.append({"name": name, "knobs": knobs, "ms_per_step": [1000 * t for t in per_step[name]],
                     "median_ms_per_step": 1000 * med, "tokens_per_s": 1 / med, "speed_vs_first": base / med})
        print(f"| {name} | {1000 * med:.1f} | {1 / med:.2f} | {base / med:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps({"context": args.context, "steps": args.steps, "rounds": args.rounds,
                                         "threads": torch.get_num_threads(), "text": str(text_path),
                                         "configs": rows}, indent=2))
    for engine in engines.values():
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
