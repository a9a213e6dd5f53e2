"""Prefetch evaluation: no prefetch vs recency/LRU prefetch vs heat-predictor prefetch, side by side in one run.

One engine, one sequence: a held-out text (not the predictor's training text) is prefilled to --context tokens
with a small warm level, so most old blocks live on the disk level (L2). From then on every L2 read really goes to
the disk: the cold file is dropped from the OS page cache and each read record is dropped again after it is read
(posix_fadvise DONTNEED, random-access advice). Rounds of teacher-forced decode steps then alternate between the
three modes (the order rotates every round), each mode with a fresh prefetcher that first sees --warmup steps
untimed. Reported per mode: the median decode tokens/s of the rounds, the prefetch hit rate (selected L2
segments already staged when the step read them), wasted prefetch bytes and predictor latency; and, from the
trace of the whole run, precision/recall of the predictor and of LRU at the selection budget.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/prefetch_eval.py --context 8000 --rounds 3 --steps 12
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from flashmemory import FlashMemoryEngine
from flashmemory.kvcache.prefetch.access_trace import trace_dataset
from flashmemory.kvcache.prefetch.heat_predictor import HeatPredictor, compare_with_lru
from flashmemory.kvcache.prefetch.prefetcher import Prefetcher

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
MODES = ("none", "lru", "predictor")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model file or folder (default: the embedded SmolLM2); the shipped "
                   "predictor was trained on SmolLM2's traces, so another model measures how it transfers")
    p.add_argument("--text", default=str(DATA / "plrabn12.txt"), help="held-out text (default plrabn12.txt)")
    p.add_argument("--context", type=int, default=8000, help="prefilled tokens")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=12, help="timed decode steps per mode and round")
    p.add_argument("--warmup", type=int, default=4, help="untimed steps a fresh prefetcher sees first")
    p.add_argument("--strategy", default="aggressive", choices=["adaptive", "aggressive"])
    p.add_argument("--active-window", type=int, default=2048)
    p.add_argument("--warm-tokens", type=int, default=2048)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--predictor", default=None, help="heat-predictor weights (default: the shipped ones)")
    p.add_argument("--json", default=None, help="write the figures here")
    p.add_argument("--save-trace", default=None, help="write the run's access trace here (.npz)")
    args = p.parse_args(argv)

    engine = FlashMemoryEngine(model_path=args.model, num_threads=args.threads, active_window=args.active_window,
                               warm_tokens=args.warm_tokens, record_traces=True)
    cache = engine.cache
    text = Path(args.text).read_text(encoding="utf-8", errors="replace")
    ids = engine.tokenizer.encode(text)
    needed = args.context + args.rounds * len(MODES) * (args.steps + args.warmup)
    if needed >= engine.max_seq_len or needed > len(ids):
        p.error(f"context + decode steps = {needed} tokens: over the model's {engine.max_seq_len} or the text's "
                f"{len(ids)}; lower --context, --rounds or --steps")
    predictor = HeatPredictor.load(args.predictor)
    seq = 1
    cache.add_sequence(seq)
    started = time.perf_counter()
    engine.forward_tokens(seq, ids[: args.context])
    prefill_s = time.perf_counter() - started
    print(f"prefilled {args.context} tokens in {prefill_s:.0f} s; L2 blocks {cache.stats()['L2_blocks']}",
          file=sys.stderr, flush=True)
    cache.disk_pool.set_uncached_reads(True)
    pos = args.context
    budget = cache.cfg.prefetch_budget_bytes
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        order = MODES[r % 3 :] + MODES[: r % 3]
        for mode in order:
            pf = None
            if mode != "none":
                pf = Prefetcher(cache.disk_pool, cache.cfg.num_layers, cache.cfg.num_kv_heads, args.strategy, budget,
                                ranker=mode, predictor=predictor if mode == "predictor" else None)
            cache.use_prefetcher(pf)
            for _ in range(args.warmup):
                engine.forward_tokens(seq, [ids[pos]])
                pos += 1
            before = pf.stats() if pf else {}
            read_before = cache.disk_pool.bytes_read
            cache.disk_pool.drop_page_cache()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                engine.forward_tokens(seq, [ids[pos]])
                pos += 1
            seconds = time.perf_counter() - t0
            row = {"tokens_per_s": args.steps / seconds, "disk_bytes_read": cache.disk_pool.bytes_read - read_before}
            if pf is not None:
                after = pf.stats()
                hits = after["prefetch_hits"] - before["prefetch_hits"]
                lookups = hits + after["prefetch_misses"] - before["prefetch_misses"]
                row.update(hit_rate=hits / max(lookups, 1), lookups=lookups,
                           prefetched_hits=after["prefetch_hits_prefetched"] - before["prefetch_hits_prefetched"],
                           late_misses=after["prefetch_late_misses"] - before["prefetch_late_misses"],
                           issued=after["prefetch_issued"] - before["prefetch_issued"],
                           wasted_bytes=after["prefetch_wasted_bytes"] - before["prefetch_wasted_bytes"],
                           predictor_ms_per_step=after["predictor_ms"], ranking_ms_per_step=after["prefetch_ranking_ms"])
                cache.use_prefetcher(None)
                pf.close()
            runs[mode].append(row)
            print(f"round {r} {mode:9s} " + " ".join(f"{k}={v:.4g}" for k, v in row.items()), file=sys.stderr,
                  flush=True)
    summary: dict[str, dict] = {}
    for mode, rows in runs.items():
        summary[mode] = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
    if args.save_trace:
        cache.trace.save(args.save_trace)
    x, y, g = trace_dataset(cache.trace, horizon_steps=1)
    quality = compare_with_lru(predictor, x, y, g)
    result = {"model": engine.config.model_path or "embedded SmolLM2", "context_tokens": args.context, "text": Path(args.text).name, "strategy": args.strategy,
              "active_window": args.active_window, "warm_tokens": args.warm_tokens, "threads": args.threads,
              "rounds": args.rounds, "steps": args.steps, "prefill_s": prefill_s, "modes": summary,
              "ranking": quality, "runs": runs}
    cache.free_sequence(seq)
    engine.close()
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
