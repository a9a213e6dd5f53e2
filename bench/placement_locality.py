"""Placement by age against placement by access locality (placement_policy="age" | "locality"),
side by side on workloads where locality should win and where it should not.

One held-out text is the document: its first --context tokens are prefilled (with a small window
and warm level, so the document's beginning lives on the disk level), then a question, then
--steps teacher-forced decode steps whose tokens are fixed by the workload, the same for every
engine:
  cite   the answer quotes the document's beginning (a chat that keeps citing its first document)
  early  the answer quotes a section at 15 % of the document (a RAG question naming an early
         section)
  plain  the text goes on after the document (plain long-text decode: nothing is cited)
The exact cache runs once per workload, the two policies `--rounds` times each in alternating
order (medians reported). Per engine and workload: decode ms/step (median), old blocks attended
per step by level (L0: the
old blocks with an L0 copy, read every step; L1/L2: the ones selection chose), disk bytes read and
bytes moved between levels per step, locality's counters, and the fidelity of the teacher-forced
steps against an exact cache (kv_cache="contiguous"): mean KL, top-1 agreement, NLL.

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. .venv/bin/python bench/placement_locality.py \\
        --text ../shared/data/plrabn12.txt --context 6000 --steps 160 --json locality.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from flashmemory import FlashMemoryEngine
from flashmemory.kvcache.manager.blocks import Level

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
WORKLOADS = ("cite", "early", "plain")
QUESTIONS = {
    "cite": "\n\nQuestion: how does the text above begin? Quote its opening word for word.\n"
            "Answer: ",
    "early": "\n\nQuestion: quote the passage that comes about a sixth of the way into the text.\n"
             "Answer: ",
    "plain": "",
}


def _workload(ids: list[int], question: list[int], name: str, context: int,
              steps: int) -> tuple[list[int], list[int]]:
    """(prompt, the teacher-forced tokens) of one workload."""
    document = ids[:context]
    if name == "plain":
        return document, ids[context : context + steps]
    start = 0 if name == "cite" else int(0.15 * context)
    return document + question, ids[start : start + steps]


def _old_blocks_on_l0(engine: FlashMemoryEngine, seq_id: int) -> int:
    """Blocks of the sequence with an L0 copy that are neither sinks nor in the window."""
    cache = engine.cache
    table = cache.blocks.tables[seq_id]
    n = len(table.blocks)
    policy = cache.policy
    return sum(1 for i, block in enumerate(table.blocks)
               if Level.DEVICE in block.slots and not block.pinned
               and n - 1 - i >= policy.window_blocks)


def _run(engine: FlashMemoryEngine, prompt: list[int], forced: list[int],
         seq_id: int) -> tuple[dict, torch.Tensor]:
    cache = engine.cache
    cache.add_sequence(seq_id)
    try:
        logits = [engine.forward_tokens(seq_id, prompt).float()]
        tiered = hasattr(cache, "reader")
        if tiered:
            reader = cache.reader
            selected0 = dict(reader.selected_blocks)
            moved0 = sum(cache.placement.bytes_moved.values())
            read0 = cache.disk_pool.bytes_read if Level.DISK in cache.levels else 0
            locality0 = cache.kv_stats().locality
        times, on_l0 = [], []
        for token in forced[:-1]:
            t0 = time.perf_counter()
            logits.append(engine.forward_tokens(seq_id, [token]).float())
            times.append(time.perf_counter() - t0)
            if tiered:
                on_l0.append(_old_blocks_on_l0(engine, seq_id))
        steps = len(times)
        row: dict = {"ms_per_step": statistics.median(times) * 1e3}
        if tiered:
            layers = cache.cfg.num_layers * cache.cfg.num_kv_heads  # choices per step and level
            for level in (Level.HOST, Level.DISK):
                chosen = reader.selected_blocks[level] - selected0.get(level, 0)
                row[f"L{int(level)}_blocks_attended_per_step"] = chosen / layers / steps
            row["L0_old_blocks_attended_per_step"] = statistics.mean(on_l0)
            moved = sum(cache.placement.bytes_moved.values()) - moved0
            row["bytes_moved_per_step"] = moved / steps
            if Level.DISK in cache.levels:
                row["disk_bytes_read_per_step"] = (cache.disk_pool.bytes_read - read0) / steps
            locality = cache.kv_stats().locality
            if locality is not None:  # this run's counts (the counters are the engine's)
                row.update({k: v - getattr(locality0, k) if isinstance(v, int) else v
                            for k, v in vars(locality).items()})
        return row, torch.cat(logits)
    finally:
        cache.free_sequence(seq_id, keep_cached=False)


def _fidelity(logits: torch.Tensor, exact: torch.Tensor, forced: list[int]) -> dict:
    p = torch.log_softmax(exact.double(), -1)
    q = torch.log_softmax(logits.double(), -1)
    target = torch.tensor(forced)
    return {"kl": (p.exp() * (p - q)).sum(-1).mean().item(),
            "top1_agreement": (q.argmax(-1) == p.argmax(-1)).double().mean().item(),
            "nll": -q.gather(1, target[:, None]).mean().item(),
            "exact_nll": -p.gather(1, target[:, None]).mean().item()}


def _median(runs: list[dict]) -> dict:
    """Each figure's median over the runs (ms_per_step's spread too)."""
    out = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    out["ms_per_step_runs"] = [r["ms_per_step"] for r in runs]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model (default: the embedded SmolLM2)")
    p.add_argument("--text", default=str(DATA / "plrabn12.txt"), help="held-out document")
    p.add_argument("--context", type=int, default=6000, help="document tokens prefilled")
    p.add_argument("--steps", type=int, default=160, help="teacher-forced decode steps")
    p.add_argument("--active-window", type=int, default=1024)
    p.add_argument("--warm-tokens", type=int, default=2048)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--rounds", type=int, default=2, help="runs of each policy, alternating")
    p.add_argument("--setting", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting of both tiered engines (e.g. locality_device_tokens=512)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    extra = dict(s.split("=", 1) for s in args.setting)
    extra = {k: int(v) if v.isdigit() else v for k, v in extra.items()}
    common = dict(model_path=args.model, num_threads=args.threads, prefix_caching=False)
    tiered = dict(common, active_window=args.active_window, warm_tokens=args.warm_tokens, **extra)
    engines = {"exact": dict(common, kv_cache="contiguous"),
               "age": dict(tiered, placement_policy="age"),
               "locality": dict(tiered, placement_policy="locality")}
    text = Path(args.text).read_text(encoding="utf-8", errors="replace")
    results: dict = {"text": Path(args.text).name, "context": args.context, "steps": args.steps,
                     "threads": args.threads, "settings": {"active_window": args.active_window,
                                                           "warm_tokens": args.warm_tokens,
                                                           **extra},
                     "load_average_start": os.getloadavg(), "runs": {}}
    built = {name: FlashMemoryEngine(**settings) for name, settings in engines.items()}
    try:
        ids = built["exact"].tokenizer.encode(text)
        seq_id = 100
        for workload in args.workloads:
            text_q = QUESTIONS[workload]
            question = built["exact"].tokenizer.encode(text_q) if text_q else []
            prompt, forced = _workload(ids, question, workload, args.context, args.steps)
            exact = None
            rows: dict[str, list[dict]] = {}
            # The exact cache once, then the two policies in alternating order, `rounds` each.
            pairs = (("age", "locality"), ("locality", "age"))
            order = ["exact"] + [n for r in range(args.rounds) for n in pairs[r % 2]]
            for name in order:
                seq_id += 1
                row, logits = _run(built[name], prompt, forced, seq_id)
                if name == "exact":
                    exact = logits
                row.update(_fidelity(logits, exact, forced))
                rows.setdefault(name, []).append(row)
                print(f"{workload:6s} {name:9s} " + " ".join(
                    f"{k}={v:.4g}" for k, v in row.items() if isinstance(v, float | int)),
                    file=sys.stderr, flush=True)
            results["runs"][workload] = {name: _median(runs) for name, runs in rows.items()}
    finally:
        for engine in built.values():
            engine.close()
    results["load_average_end"] = os.getloadavg()
    print(json.dumps(results, indent=1))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
