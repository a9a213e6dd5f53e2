"""Two (or more) checkouts of FlashMemory side by side: the same generation, interleaved, medians.

Each tree gets one persistent worker process (PYTHONPATH = the tree) that loads the engine once; rounds then
alternate between the workers (A B A B ...), each round one `engine.generate` of --new-tokens greedy tokens after
the same --context-token prompt, so a shared, noisy machine slows every tree alike. Reports the median prefill and
decode tokens/s (the engine's own GenerationStats) and the ratio to the first tree. For checking that a refactor
changed no speed:

    git worktree add /tmp/fm-before <commit>
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/compare_trees.py --tree before=/tmp/fm-before --tree after=. \\
        --context 2048 --new-tokens 32 --rounds 5

With --sequences 1 4 8, a round is instead one `engine.generate` of that many sequences at once
for each count (every tree, then the next count), all with the same prompt: each worker generates
it once first, so its full blocks are in the prefix cache and every sequence of a round reuses them
(a round computes one block of prompt per sequence, then decodes). Reported: batched decode
tokens/s, all sequences' tokens summed, over the steps in which every sequence decoded and nothing
else ran (timed around `engine.step_core`). Give the engine room for the largest count, e.g.
`--knob max_num_seqs=8`.
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
import json, sys, time
from flashmemory import FlashMemoryEngine
cfg = json.loads(sys.argv[1])
engine = FlashMemoryEngine(cfg["model"], **cfg["knobs"])
text = open(cfg["text"], encoding="utf-8", errors="replace").read()
ids = engine.tokenizer.encode(text)[: cfg["context"]]


class StepTokens:
    # What the engine core reports in one step: prompt tokens computed and tokens sampled.
    prefill = sampled = 0

    def on_prefill_tokens(self, n):
        self.prefill += n

    def on_token(self, since_s, first):
        self.sampled += 1

    def on_finished(self, reason, e2e_s):
        pass

    def on_preempted(self, kind, n):
        pass

    def on_fault(self, action):
        pass


steps = []  # (seconds, prompt tokens, sampled tokens) of each step of a batched round
if cfg["sequences"]:
    seen = StepTokens()
    engine.configure_core(observer=seen)
    step_core = engine.step_core

    def timed_step(core):
        seen.prefill = seen.sampled = 0
        started = time.perf_counter()
        out = step_core(core)
        steps.append((time.perf_counter() - started, seen.prefill, seen.sampled))
        return out

    engine.step_core = timed_step
    engine.generate(ids, max_new_tokens=2, ignore_eos=True)  # its blocks go to the prefix cache
print(json.dumps({"ready": True, "prompt_tokens": len(ids)}), flush=True)
for line in sys.stdin:
    n = int(line.split()[1]) if len(line.split()) > 1 else 0
    if n:
        steps.clear()
        engine.generate([ids] * n, max_new_tokens=cfg["new_tokens"], ignore_eos=True)
        full = [(sec, tok) for sec, pre, tok in steps if pre == 0 and tok == n]  # all decoded
        if not full:
            sys.exit(f"no step decoded all {n} sequences at once: raise max_num_seqs "
                     f"(--knob max_num_seqs={n})")
        print(json.dumps({"decode_tok_s": sum(t for _, t in full) / sum(s for s, _ in full),
                          "decode_steps": len(full)}), flush=True)
        continue
    engine.generate(ids, max_new_tokens=cfg["new_tokens"], ignore_eos=True)
    s = engine.last_stats
    print(json.dumps({"prefill_tok_s": s.prefill_tokens_per_s, "decode_tok_s": s.decode_tokens_per_s,
                      "ttft_s": s.time_to_first_token_s}), flush=True)
"""


def cpu_description() -> dict:
    """The CPU's model and the vector extensions the kernels use (-march=native compiles for)."""
    info = {"model": "", "flags": []}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not info["model"]:
                info["model"] = value.strip()
            elif key.strip() == "flags" and not info["flags"]:
                wanted = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni",
                          "amx_tile")
                info["flags"] = [f for f in wanted if f in value.split()]
    except OSError:
        pass
    info["cpus"] = os.cpu_count()
    return info


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
    p.add_argument("--sequences", type=int, nargs="+", default=None, metavar="N",
                   help="batched decode of N sequences at once per round, for each N (see above)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    knobs = {}
    for kv in args.knob:
        key, _, value = kv.partition("=")
        knobs[key] = int(value) if value.isdigit() else value
    cfg = {"model": args.model, "knobs": knobs, "text": args.text, "context": args.context,
           "new_tokens": args.new_tokens, "sequences": args.sequences}
    trees = [(spec.partition("=")[0], Path(spec.partition("=")[2])) for spec in args.tree]
    load_before = os.getloadavg()
    workers = {name: _start(path, cfg) for name, path in trees}
    counts = args.sequences or [0]
    runs: dict[str, dict[int, list[dict]]] = {name: {n: [] for n in counts} for name, _ in trees}
    try:
        for r in range(args.rounds):
            for n in counts:
                for name, proc in workers.items():
                    proc.stdin.write(f"run {n}\n")
                    proc.stdin.flush()
                    runs[name][n].append(json.loads(proc.stdout.readline()))
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        for proc in workers.values():
            proc.stdin.close()
            proc.wait(timeout=60)
    load = os.getloadavg()
    first = trees[0][0]
    med = {name: {n: {k: statistics.median(run[k] for run in runs[name][n])
                      for k in runs[name][n][0]} for n in counts} for name in runs}
    cpu = cpu_description()
    loads = f"{load_before[0]:.1f} before, {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} after"
    print(f"\n{args.context}-token prompt, {args.new_tokens} new tokens, {args.rounds} "
          f"interleaved rounds, load average {loads}; {cpu['model']} ({cpu['cpus']} CPUs; "
          f"{' '.join(cpu['flags'])})\n")
    if args.sequences:
        print("| sequences | tree | decode tok/s (all sequences) | per round | vs first |")
        print("|---:|---|---:|---|---:|")
        for n in counts:
            for name in runs:
                m = med[name][n]["decode_tok_s"]
                each = " ".join(f"{run['decode_tok_s']:.1f}" for run in runs[name][n])
                ratio = m / med[first][n]["decode_tok_s"]
                print(f"| {n} | {name} | {m:.2f} | {each} | {ratio:.2f}x |")
    else:
        print("| tree | prefill tok/s | decode tok/s | TTFT s | decode vs first |")
        print("|---|---:|---:|---:|---:|")
        for name in runs:
            m = med[name][0]
            ratio = m["decode_tok_s"] / med[first][0]["decode_tok_s"]
            print(f"| {name} | {m['prefill_tok_s']:.0f} | {m['decode_tok_s']:.2f} | "
                  f"{m['ttft_s']:.2f} | {ratio:.2f}x |")
    if args.json:
        flat = {name: runs[name] if args.sequences else runs[name][0] for name in runs}
        medians = {name: med[name] if args.sequences else med[name][0] for name in med}
        record = {"config": cfg, "trees": {n: str(p) for n, p in trees}, "runs": flat,
                  "medians": medians, "load_average_before": load_before, "load_average": load,
                  "cpu": cpu}
        args.json.write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
