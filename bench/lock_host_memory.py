"""lock_host_memory (--disable-swap) at start-up: what locking the L1 pool costs in start-up time
and resident memory, and what the process then has locked (VmLck), against the same engine
unlocked; one fresh process per run, interleaved.

    PYTHONPATH=. .venv/bin/python bench/lock_host_memory.py --cpu-memory-gb 1 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = """
import json, sys, time
from flashmemory import FlashMemoryEngine
from flashmemory.kvcache.levels.memory_lock import locked_bytes
from flashmemory.rss import peak_rss_bytes
t = time.perf_counter()
e = FlashMemoryEngine(cpu_memory_gb=float(sys.argv[1]), lock_host_memory=sys.argv[2] == "1")
load = time.perf_counter() - t
text = e.generate("The sea is", max_new_tokens=8, ignore_eos=True)
print(json.dumps({"load_s": load, "locked": locked_bytes(), "peak_rss": peak_rss_bytes()}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-memory-gb", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {"unlocked": [], "locked": []}
    for _ in range(args.rounds):
        for mode in runs:
            out = subprocess.run([sys.executable, "-c", CHILD, str(args.cpu_memory_gb),
                                  "1" if mode == "locked" else "0"],
                                 capture_output=True, text=True, check=True)
            runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"load {os.getloadavg()}; L1 pool cpu_memory_gb={args.cpu_memory_gb:g}, "
          f"{args.rounds} fresh processes each\n")
    print("| L1 pool | start-up s (median) | VmLck MiB | peak RSS MiB |")
    print("|---|---:|---:|---:|")
    for mode, rows in runs.items():
        print(f"| {mode} | {statistics.median(r['load_s'] for r in rows):.2f} | "
              f"{rows[0]['locked'] / 2**20:.1f} | "
              f"{statistics.median(r['peak_rss'] for r in rows) / 2**20:.0f} |")


if __name__ == "__main__":
    main()
