"""The shared KV level (remote_kv_url): a document prefilled through one engine (replica A)
and asked on another that never saw it (replica B), its blocks read from Redis, against B
computing it; the same greedy answer is the rule.

A local redis-server is started on a free port. Engine A prefills the document and one question
and publishes its blocks. Then, per round, both modes on a fresh engine with an empty cache of
its own (interleaved, so the machine's load falls on both alike): "recompute" (no shared level)
and "remote" (the shared level on), each asked the same new question about the document. TTFT
is the engine's own first-token time; the remote mode's includes the lookup, the reads and the
installation of every block.

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. .venv/bin/python bench/shared_level_ttft.py \\
        --doc-tokens 8000 --rounds 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from flashmemory import FlashMemoryEngine
from flashmemory.cpu_features import describe
from flashmemory.tools.redis_server import LocalRedis

TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "lcet10.txt"
MODES = ("recompute", "remote")


def question(i: int) -> str:
    return f"\n\nQuestion {i}: in one sentence, what is this text about? Answer:"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF or HF folder; default the embedded SmolLM2")
    ap.add_argument("--text", type=Path, default=TEXT)
    ap.add_argument("--doc-tokens", type=int, default=8000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="fm-shared-bench-"))
    with LocalRedis(root / "redis") as redis:
        def engine(name: str, remote: bool) -> FlashMemoryEngine:
            extra = dict(remote_kv_url=redis.url) if remote else {}
            return FlashMemoryEngine(args.model, num_threads=args.threads,
                                     cold_zone_dir=str(root / name), **extra)

        a = engine("a", True)
        doc = a.tokenizer.encode(args.text.read_text(encoding="utf-8", errors="replace"))
        doc = doc[: args.doc_tokens]

        def ask(e: FlashMemoryEngine, i: int) -> tuple[float, str]:
            ids = doc + e.tokenizer.encode(question(i), add_special_tokens=False)
            text = e.generate(ids, max_new_tokens=args.new_tokens, ignore_eos=True)
            return e.last_stats.time_to_first_token_s, text

        started = time.perf_counter()
        first, _ = ask(a, 0)
        a.cache.shared.flush()
        published = a.stats()
        a.close()
        cpu = describe()
        print(f"load {os.getloadavg()}; CPU {cpu['model']} ({', '.join(cpu['flags'])})\n"
              f"{len(doc)}-token document; replica A's "
              f"prefill TTFT {first:.2f} s, {published['remote_kv_published_blocks']} blocks "
              f"published ({time.perf_counter() - started:.1f} s); Redis used_memory "
              f"{redis.client().info('memory')['used_memory']:,} bytes\n")
        rows: dict[str, list[dict]] = {m: [] for m in MODES}
        for r in range(args.rounds):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                e = engine(f"{mode}-{r}", mode == "remote")
                ttft, text = ask(e, r + 1)
                stats = e.stats()
                rows[mode].append({"ttft_s": ttft, "text": text,
                                   "hit_blocks": stats.get("remote_kv_hit_blocks", 0),
                                   "prefix_hits": stats["prefix_cache_hits"]})
                e.close()
        same = [rows["remote"][r]["text"] == rows["recompute"][r]["text"]
                for r in range(args.rounds)]
        ttft = {m: statistics.median(x["ttft_s"] for x in rows[m]) for m in MODES}
        print("| replica B | TTFT s (median) | of recompute | blocks from Redis | tokens reused |")
        print("|---|---:|---:|---:|---:|")
        for m in MODES:
            print(f"| {m} | {ttft[m]:.3f} | {ttft[m] / ttft['recompute']:.1%} | "
                  f"{rows[m][0]['hit_blocks']} | {rows[m][0]['prefix_hits']} |")
        print(f"\nthe same greedy answer in {sum(same)} of {len(same)} rounds; "
              f"load {os.getloadavg()}")
        if args.json:
            args.json.write_text(json.dumps({"doc_tokens": len(doc), "threads": args.threads,
                                             "publisher_ttft_s": first, "rounds": rows,
                                             "ttft_median_s": ttft, "same_answer": same,
                                             "cpu": cpu}, indent=1))


if __name__ == "__main__":
    main()
