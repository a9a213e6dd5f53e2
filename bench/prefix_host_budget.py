"""A long document asked twice, under several `prefix_cache_host_mb` bounds and with the prefix cache off: the second
question's TTFT, the tokens it reused, the reuses cut at a block left only at INT2, and whether its greedy answer is
recompute's. One engine at a time, one process.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/prefix_host_budget.py --host-mb 64 256 --json out.json

Unused cached blocks beyond the bound give their FP16 L1 copy up for an INT2 one on L2; the prefix cache does not
reuse such a block where a fresh prefill keeps it in FP16 (docs/prefix_cache.md), so a document whose FP16 KV is over
the bound is partly computed again.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
QUESTIONS = ("\n\nQuestion: who is the story about? Answer:", "\n\nQuestion: what happened at the tea party? Answer:")


def ask_twice(knobs: dict, args: argparse.Namespace) -> list[dict]:
    from flashmemory import FlashMemoryEngine

    engine = FlashMemoryEngine(args.model, num_threads=args.threads, **knobs)
    try:
        doc = engine.tokenizer.encode(Path(args.text).read_text(encoding="utf-8", errors="replace"))[: args.doc_tokens]
        rows = []
        for question in QUESTIONS:
            ids = doc + engine.tokenizer.encode(question, add_special_tokens=False)
            answer = engine.generate(ids, max_new_tokens=args.new_tokens, ignore_eos=True)
            stats = engine.stats()
            rows.append({"ttft_s": engine.last_stats.time_to_first_token_s, "answer": answer,
                         "reused_tokens": stats.get("prefix_cache_hits", 0),
                         "lossy_refusals": stats.get("prefix_cache_lossy_refusals", 0)})
        return rows
    finally:
        engine.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF or folder (default: the embedded SmolLM2)")
    ap.add_argument("--text", default=str(ROOT.parent / "shared" / "data" / "alice29.txt"))
    ap.add_argument("--doc-tokens", type=int, default=8000)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--host-mb", type=float, nargs="+", default=[64.0, 256.0], help="prefix_cache_host_mb values")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    runs = {"recompute": ({"prefix_caching": False}, None)}
    runs.update({f"{mb:g} MiB": ({"prefix_cache_host_mb": mb}, mb) for mb in args.host_mb})
    results = {name: ask_twice(knobs, args) for name, (knobs, _) in runs.items()}
    reference = results["recompute"][1]["answer"]
    print(f"\n{args.doc_tokens}-token document asked twice, {args.threads} thread(s), load {os.getloadavg()[0]:.1f}\n")
    print("| prefix_cache_host_mb | 1st TTFT s | 2nd TTFT s | 2nd / 1st | reused tokens | cut at an INT2 block | "
          "2nd answer = recompute's |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name, (first, second) in results.items():
        print(f"| {name} | {first['ttft_s']:.2f} | {second['ttft_s']:.2f} | {second['ttft_s'] / first['ttft_s']:.1%} | "
              f"{second['reused_tokens']:,} | {second['lossy_refusals']} | {second['answer'] == reference} |")
    if args.json:
        args.json.write_text(json.dumps({"doc_tokens": args.doc_tokens, "threads": args.threads, "results": results},
                                        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
