"""Heat-predictor latency per decode step, alone: the shipped MLP over one step's candidate rows.

A step at 8K context with SmolLM2-135M ranks 30 layers x 3 KV heads x ~250 L2 blocks = 22,590 rows. With
--trace (a trace of real decoding, e.g. `bench/prefetch_eval.py --save-trace`), the rows are the real feature rows
of its last L2 steps, replayed through AccessStats; without, they are drawn around the training features' mean and
spread (more of them pass the eligibility filter than in real steps: an upper bound). Reported: the median of
--repeats calls of `rank` (the prefetcher's call: the MLP on eligible rows only, in the C kernel) and of `logits`
(every row), and `rank` through the torch fallback.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/predictor_latency.py --trace plrabn12_8k.npz
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch

from flashmemory.kvcache.prefetch.access_stats import NUM_FEATURES
from flashmemory.kvcache.prefetch.heat_predictor import HeatPredictor, eligible_rows


def _median_ms(fn, repeats: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def _last_l2_step(path: str) -> torch.Tensor:
    """Feature rows [F, rows] of the trace's last L2 step (every layer), after replaying the whole trace."""
    from flashmemory.kvcache.prefetch.access_stats import AccessStats, StepChoices
    from flashmemory.kvcache.prefetch.access_trace import TraceRecorder, stack_events, trace_steps

    trace = TraceRecorder.load(path)
    layers = 1 + max(e.layer for e in trace.events)
    heads = trace.events[0].scores.shape[0]
    stats: dict[int, AccessStats] = {}
    last: tuple[AccessStats, StepChoices] | None = None
    for seq_id, events in trace_steps(trace.events):
        step = stack_events(events)
        st = stats.setdefault(seq_id, AccessStats(layers, heads))
        st.update(step)
        if step.level == 2:
            last = (st, step)
    if last is None:
        raise SystemExit(f"{path}: no L2 choices in this trace")
    features = last[0].features(last[1])
    return features.reshape(features.shape[0], -1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=22_590, help="candidate rows per step (default: 8K context)")
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--predictor", default=None, help="weights (default: the shipped ones)")
    p.add_argument("--trace", default=None, help="replay this access trace (.npz) for real feature rows")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    predictor = HeatPredictor.load(args.predictor)
    if args.trace:
        x = _last_l2_step(args.trace)
    else:
        rng = np.random.default_rng(0)
        spread = rng.normal(size=(NUM_FEATURES, args.rows)).astype(np.float32)
        x = torch.from_numpy(predictor.w["mean"][:, None] + predictor.w["std"][:, None] * spread)
    eligible = eligible_rows(x)
    rows_major = x.T.contiguous()
    result = {"rows": x.shape[1], "source": args.trace or "synthetic", "eligible_fraction": float(eligible.float().mean()),
              "parameters": predictor.num_parameters, "kernel": predictor._lib is not None,
              "rank_ms": _median_ms(lambda: predictor.rank(x), args.repeats),
              "logits_all_rows_ms": _median_ms(lambda: predictor.logits(rows_major), args.repeats)}
    predictor._lib = None
    result["torch_rank_ms"] = _median_ms(lambda: predictor.rank(x), args.repeats // 4)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
