"""Preload (seed 004 §4): a document's next question after a restart, with and without
`engine.preload(document)` first (the conversation's KV brought up from the disk level "while
the user types"), and the same in one process (the KV in host memory). TTFT from the engine's own
first token; the restarts read the cold file past the OS page cache (cold_zone_uncached_reads);
each question is new, so only the document is cached; rounds interleave the two modes.

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. .venv/bin/python bench/preload_ttft.py \
        --doc-tokens 8000 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from flashmemory import FlashMemoryEngine

TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "lcet10.txt"
MODES = ("no preload", "preloaded")


def question(i: int) -> str:
    return f"\n\nQuestion {i}: in one sentence, what is this text about? Answer:"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF or HF folder; default the embedded SmolLM2")
    ap.add_argument("--text", type=Path, default=TEXT)
    ap.add_argument("--doc-tokens", type=int, default=8000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    folder = tempfile.mkdtemp(prefix="fm-preload-bench-")
    knobs = dict(num_threads=args.threads, cold_zone_dir=folder, persist_cache=True)
    engine = FlashMemoryEngine(args.model, **knobs)
    doc = engine.tokenizer.encode(args.text.read_text(encoding="utf-8", errors="replace"))
    doc = doc[: args.doc_tokens]
    asked = iter(range(1000))

    def ask(e: FlashMemoryEngine) -> tuple[float, str]:
        ids = doc + e.tokenizer.encode(question(next(asked)), add_special_tokens=False)
        text = e.generate(ids, max_new_tokens=8, ignore_eos=True)
        return e.last_stats.time_to_first_token_s, text

    first, _ = ask(engine)
    print(f"load {os.getloadavg()}; {len(doc)}-token document, first question (full prefill) "
          f"TTFT {first:.2f} s\n")
    memory: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(args.rounds):  # in one process: the document's KV in host memory
        for mode in MODES:
            if mode == "preloaded":
                engine.preload(doc)
            memory[mode].append(ask(engine)[0])
    engine.close()  # writes the cached blocks down and publishes the index
    restart: dict[str, list[tuple[float, float, int]]] = {m: [] for m in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            e = FlashMemoryEngine(args.model, cold_zone_uncached_reads=True, **knobs)
            before = e.stats().get("L2_bytes_read", 0)
            seconds = e.preload(doc).seconds if mode == "preloaded" else 0.0
            ttft, _ = ask(e)
            restart[mode].append((ttft, seconds, e.stats().get("L2_bytes_read", 0) - before))
            e.close()
    print("| where the document's KV is | mode | TTFT s (median) | preload s | L2 bytes read |")
    print("|---|---|---:|---:|---:|")
    for mode in MODES:
        ttft = statistics.median(memory[mode])
        print(f"| host memory (same process) | {mode} | {ttft:.3f} | - | - |")
    for mode in MODES:
        rows = restart[mode]
        print(f"| disk (after a restart) | {mode} | {statistics.median(r[0] for r in rows):.3f} | "
              f"{statistics.median(r[1] for r in rows):.3f} | {rows[0][2]:,} |")


if __name__ == "__main__":
    main()
