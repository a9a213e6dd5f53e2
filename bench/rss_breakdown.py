"""Where a decode process's resident memory goes, stage by stage: the interpreter, torch's import, the engine's
import, the model's weights, the KV levels' pools, a prefill of N tokens and decode steps. Each stage's figure is
the growth of VmRSS (resident now) and VmHWM (peak) over the stage before, read from /proc/self/status, in one
process holding only this engine — the way `flashmemory bench --decode-only` measures its peak RSS.

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. .venv/bin/python bench/rss_breakdown.py --context 512 --threads 1
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

MIB = 2**20


def _status() -> dict[str, int]:
    values = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            values[key] = int(rest.split()[0]) * 1024
    return values


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--text", type=Path, default=None, help="long text (default: ../shared/data/alice29.txt)")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--setting", action="append", default=[], metavar="KEY=VALUE", help="an engine setting")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    stages: list[tuple[str, dict[str, int]]] = [("interpreter", _status())]
    import torch  # noqa: F401

    stages.append(("import torch", _status()))
    from flashmemory import FlashMemoryEngine
    from flashmemory.tools.eval import default_text_path

    stages.append(("import flashmemory", _status()))
    settings = dict(s.split("=", 1) for s in args.setting)
    engine = FlashMemoryEngine(model_path=args.model, num_threads=args.threads,
                               max_seq_len=args.context + args.steps + 16, **settings)
    weights = engine.model.num_parameter_bytes()
    stages.append(("engine built (weights, KV pools, kernels)", _status()))
    ids = engine.tokenizer.encode(Path(args.text or default_text_path()).read_text(errors="replace"),
                           add_special_tokens=False)
    while len(ids) < args.context + args.steps:
        ids += ids
    stages.append(("text tokenized", _status()))
    seq_id = engine.core.next_seq_id()
    engine.cache.add_sequence(seq_id)
    engine.forward_tokens(seq_id, ids[: args.context])
    stages.append((f"prefill of {args.context} tokens", _status()))
    for pos in range(args.context, args.context + args.steps):
        engine.forward_tokens(seq_id, [ids[pos]])
    stages.append((f"{args.steps} decode steps", _status()))
    kv = {k: v for k, v in engine.stats().items()
          if k in ("L0_bytes", "L1_bytes_committed", "L2_bytes_committed", "selection_digest_bytes")}
    rows = []
    print(f"{'stage':<44} {'RSS MiB':>8} {'+RSS':>7} {'peak MiB':>9} {'+peak':>7} {'anon':>7} {'file':>7}")
    for i, (name, now) in enumerate(stages):
        before = stages[i - 1][1] if i else {k: 0 for k in now}
        row = {"stage": name, **{k: v / MIB for k, v in now.items()},
               "rss_growth_mib": (now["VmRSS"] - before["VmRSS"]) / MIB,
               "peak_growth_mib": (now["VmHWM"] - before["VmHWM"]) / MIB}
        rows.append(row)
        print(f"{name:<44} {row['VmRSS']:>8.1f} {row['rss_growth_mib']:>+7.1f} {row['VmHWM']:>9.1f} "
              f"{row['peak_growth_mib']:>+7.1f} {row['RssAnon']:>7.1f} {row['RssFile']:>7.1f}")
    print(f"weights as stored: {weights / MIB:.1f} MiB ({engine.config.weights_dtype}); "
          f"torch threads {torch.get_num_threads()}; KV held at the end (MiB): "
          + ", ".join(f"{k} {v / MIB:.1f}" for k, v in kv.items()))
    result = {"context": args.context, "steps": args.steps, "threads": args.threads, "settings": settings,
              "weights_bytes": weights, "kv_bytes": kv, "model": str(engine.model_path), "stages": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
