"""The guardrail's classifier on a labelled set written for this repository (bench/data/
guardrail_labelled.jsonl: 30 toxic and 30 clean sentences, harmless uses of "kill", "garbage" or
"damn" among the clean ones): accuracy, precision and recall at the threshold, int8 against
float32 (scores and bytes), and the latency of one check as the pool runs it (torch with one
thread), p50 / p99 over interleaved rounds. With --engine, decode ms/token of the embedded SmolLM2
with and without the guardrail, interleaved (the checks run on their own thread).

    PYTHONPATH=. .venv/bin/python bench/guardrail_quality.py --rounds 20 --engine
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from flashmemory.guardrail.loader import load_guardrail
from flashmemory.guardrail_settings import TOXIC_COMMENT_CLASSIFIER

SET = Path(__file__).resolve().parent / "data" / "guardrail_labelled.jsonl"
PRECISIONS = ("float32", "int8")
PROMPT = "Write a short story about a lighthouse keeper and a storm."


def quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def quality(path: str, rows: list[dict], threshold: float, rounds: int) -> None:
    torch.set_num_threads(1)
    classifiers = {p: load_guardrail(path, p) for p in PRECISIONS}
    scores = {p: [max(classifiers[p].scores(r["text"]).values()) for r in rows] for p in PRECISIONS}
    latency: dict[str, list[float]] = {p: [] for p in PRECISIONS}
    for _ in range(rounds):  # interleaved: the machine's load hits both alike
        for p in PRECISIONS:
            for r in rows:
                t0 = time.perf_counter()
                classifiers[p].scores(r["text"])
                latency[p].append(time.perf_counter() - t0)
    print("| precision | accuracy | precision | recall | weights bytes | check p50 ms "
          "| check p99 ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for p in PRECISIONS:
        flagged = [s >= threshold for s in scores[p]]
        truth = [r["toxic"] for r in rows]
        tp = sum(f and t for f, t in zip(flagged, truth))
        right = sum(f == t for f, t in zip(flagged, truth))
        print(f"| {p} | {right}/{len(rows)} ({right / len(rows):.1%}) | {tp}/{sum(flagged)} | "
              f"{tp}/{sum(truth)} | {classifiers[p].weights_bytes():,} | "
              f"{1e3 * statistics.median(latency[p]):.2f} | "
              f"{1e3 * quantile(latency[p], 0.99):.2f} |")
    diff = [abs(a - b) for a, b in zip(scores["int8"], scores["float32"])]
    pairs = list(zip(scores["int8"], scores["float32"]))
    changed = sum((a >= threshold) != (b >= threshold) for a, b in pairs)
    print(f"\nint8 vs float32: top score |diff| max {max(diff):.4f}, "
          f"mean {statistics.mean(diff):.4f}; "
          f"{changed} of {len(rows)} verdicts differ")
    for r, s in zip(rows, scores["int8"]):
        if (s >= threshold) != r["toxic"]:
            label = "toxic" if r["toxic"] else "clean"
            print(f"  wrong (int8 {s:.2f}, labelled {label}): {r['text']}")


def engine_overhead(path: str, rounds: int, tokens: int) -> None:
    from flashmemory import FlashMemoryEngine

    engines = {"no guardrail": FlashMemoryEngine(),
               "guardrail": FlashMemoryEngine(guardrail_path=path)}
    ms: dict[str, list[float]] = {k: [] for k in engines}
    for _ in range(rounds):
        for name, engine in engines.items():
            engine.generate(PROMPT, max_new_tokens=tokens, ignore_eos=True)
            s = engine.last_stats
            ms[name].append(1e3 * (s.decode_seconds / max(1, s.num_generated_tokens - 1)))
    print(f"\n| engine | decode ms/token (median of {rounds}) | checks |")
    print("|---|---:|---|")
    for name, engine in engines.items():
        checks = {k: v for k, v in engine.stats().items() if k.startswith("guardrail_")}
        print(f"| {name} | {statistics.median(ms[name]):.1f} | {checks or '-'} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", type=Path, default=SET)
    ap.add_argument("--path", default=TOXIC_COMMENT_CLASSIFIER)
    ap.add_argument("--threshold", type=float, default=0.5)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--engine", action="store_true", help="also time decode with and without it")
    ap.add_argument("--engine-tokens", type=int, default=64)
    args = ap.parse_args()
    rows = [json.loads(line) for line in args.set.read_text().splitlines() if line.strip()]
    print(f"load average {os.getloadavg()}, torch {torch.__version__}, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}\n")
    quality(args.path, rows, args.threshold, args.rounds)
    if args.engine:
        engine_overhead(args.path, max(3, args.rounds // 4), args.engine_tokens)


if __name__ == "__main__":
    main()
