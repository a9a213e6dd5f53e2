"""Two (or more) checkouts of FlashMemory side by side: the same generation, interleaved, medians.

Each tree gets one persistent worker process (PYTHONPATH = the tree) that loads the engine once; rounds then
alternate between the workers (A B A B ...), each round one `engine.generate` of --new-tokens greedy tokens after
the same --context-token prompt, so a shared, noisy machine slows every tree alike. Reports the median prefill and
decode tokens/s (the engine's own GenerationStats) and the ratio to the first tree. For checking that a refactor
changed no speed:

    git worktree add /tmp/fm-before <commit>
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/compare_trees.py --tree before=/tmp/fm-before --tree after=. \\
        --context 2048 --new-tokens 32 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

WORKER = r"""
import json, sys
from flashmemory import FlashMemoryEngine
cfg = json.loads(sys.argv[1])
engine = FlashMemoryEngine(cfg["model"], **cfg["knobs"])
text = open(cfg["text"], encoding="utf-8", errors="replace").read()
ids = engine.tokenizer.encode(text)[: cfg["context"]]
print(json.dumps({"ready": True, "prompt_tokens": len(ids)}), flush=True)
for line in sys.stdin:
    engine.generate(ids, max_new_tokens=cfg["new_tokens"], ignore_eos=True)
    s = engine.last_stats
    print(json.dumps({"prefill_tok_s": s.prefill_tokens_per_s, "decode_tok_s": s.decode_tokens_per_s,
                      "ttft_s": s.time_to_first_token_s}), flush=True)
"""


def _start(tree: Path, cfg: dict) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    proc = subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(cfg)], env=env, cwd=str(tree.resolve()),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ready = json.loads(proc.stdout.readline())
    assert ready.get("ready"), ready
    return proc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", required=True, metavar="NAME=PATH", help="a checkout (repeatable)")
    p.add_argument("--model", default=None, help="checkpoint (default: the embedded SmolLM2)")
    p.add_argument("--text", default=str(Path(__file__).resolve().parents[2] / "shared" / "data" / "alice29.txt"))
    p.add_argument("--context", type=int, default=2048, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--knob", action="append", default=[], metavar="KEY=VALUE", help="engine setting (repeatable)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    knobs = {}
    for kv in args.knob:
        key, _, value = kv.partition("=")
        knobs[key] = int(value) if value.isdigit() else value
    cfg = {"model": args.model, "knobs": knobs, "text": args.text, "context": args.context,
           "new_tokens": args.new_tokens}
    trees = [(spec.partition("=")[0], Path(spec.partition("=")[2])) for spec in args.tree]
    workers = {name: _start(path, cfg) for name, path in trees}
    runs: dict[str, list[dict]] = {name: [] for name, _ in trees}
    try:
        for r in range(args.rounds):
            for name, proc in workers.items():
                proc.stdin.write("run\n")
                proc.stdin.flush()
                runs[name].append(json.loads(proc.stdout.readline()))
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        for proc in workers.values():
            proc.stdin.close()
            proc.wait(timeout=60)
    load = os.getloadavg()
    first = trees[0][0]
    med = {name: {k: statistics.median(run[k] for run in runs[name]) for k in runs[name][0]} for name in runs}
    print(f"\n{args.context}-token prompt, {args.new_tokens} new tokens, {args.rounds} interleaved rounds, "
          f"load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}\n")
    print("| tree | prefill tok/s | decode tok/s | TTFT s | decode vs first |")
    print("|---|---:|---:|---:|---:|")
    for name in runs:
        m = med[name]
        print(f"| {name} | {m['prefill_tok_s']:.0f} | {m['decode_tok_s']:.2f} | {m['ttft_s']:.2f} | "
              f"{m['decode_tok_s'] / med[first]['decode_tok_s']:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps({"config": cfg, "trees": dict((n, str(p)) for n, p in trees), "runs": runs,
                                         "medians": med, "load_average": load}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
