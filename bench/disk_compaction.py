"""Compaction of the disk level on a mixed workload: long and short requests whose older KV went to
the cold file, one long conversation per round kept as a saved session, then clear_cache (every
other cached block freed, the sessions' records left among the freed ones) and compaction: the
file's allocated bytes and its fragmentation (the share holding freed records) before and after,
the time it took, and decode ms/token of a request before and after (compaction runs between
steps, never in one).

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. .venv/bin/python bench/disk_compaction.py --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from flashmemory import FlashMemoryEngine

TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "plrabn12.txt"
MIB = 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", type=Path, default=TEXT)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    # A small window and warm span so that most of each request's KV lives on the disk level.
    engine = FlashMemoryEngine(num_threads=args.threads, active_window=256, warm_tokens=256,
                               cold_zone_dir=tempfile.mkdtemp())
    words = args.text.read_text(encoding="utf-8", errors="replace").split()
    lengths = [3000, 200, 1500, 120, 2500, 300]  # long and short, interleaved

    def decode_ms() -> float:
        engine.generate(" ".join(words[:1500]), max_new_tokens=24, ignore_eos=True)
        s = engine.last_stats
        return 1e3 * s.decode_seconds / max(1, s.num_generated_tokens - 1)

    def disk() -> tuple[int, int]:
        st = engine.stats()
        return st["L2_bytes_committed"], st["L2_bytes_reclaimable"]

    print(f"load {os.getloadavg()}\n")
    print("| round | file MiB before | freed MiB | fragmentation | compaction s | file MiB after | "
          "decode ms/token before | after |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    start = 0
    for r in range(args.rounds):
        for i, n in enumerate(lengths):
            engine.generate(" ".join(words[start:start + n]), max_new_tokens=8, ignore_eos=True)
            start += n
            if i == 0:  # one long conversation per round is kept as a saved session
                engine.save_session(f"kept-{r}", engine.last_token_ids)
        # The operator frees the cache (engine.clear_cache, seed 000 §4.1): every cached block but
        # the saved sessions' is freed, and their records interleave with the freed ones.
        engine.clear_cache()
        before_ms = statistics.median(decode_ms() for _ in range(2))
        committed, freed = disk()
        result = engine.compact_kv()["L2"]
        after_ms = statistics.median(decode_ms() for _ in range(2))
        print(f"| {r + 1} | {committed / MIB:.1f} | {freed / MIB:.1f} | "
              f"{freed / committed if committed else 0:.0%} | {result.seconds:.3f} | "
              f"{result.bytes_after / MIB:.1f} | {before_ms:.1f} | {after_ms:.1f} |")
    print(f"\n{engine.stats()['L2_blocks']} L2 blocks held by {len(engine.sessions())} sessions")
    engine.close()


if __name__ == "__main__":
    main()
