"""Where one decode step goes: weights (every projection and the LM head), attention (the decode kernel and the
reads it needs), selection (Quest block scoring and the read plan) and glue (everything else: norms, RoPE,
SwiGLU, residuals, Python), median ms over teacher-forced steps at one context length.
Where a layer runs as two native calls (model/native/decode_layer.py), its norms, RoPE, SwiGLU
and residuals count as weights (microseconds a layer beside its GEMVs).

Timers wrap functions at call time (torch.nn.functional.linear, QuantizedLinear.forward where it exists, the
tiered cache's reader.choose_batch / reader.plan and attention.decode_batch, or the
per-sequence choose and decode of older checkouts), so the script runs unchanged on older
checkouts (PYTHONPATH=that checkout) for a before/after comparison.

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. .venv/bin/python bench/step_profile.py --context 8100 --threads 2

With --kv-snapshot (written by `flashmemory eval --kv-snapshot`, same model and text) the context but its last
prefill chunk is restored from the file instead of prefilled, so a 32K step is profiled in minutes:

    bench/step_profile.py --model $M --text ../shared/data/lcet10.txt --context 32700 --kv-snapshot $S --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

from flashmemory import FlashMemoryEngine
from flashmemory.model.tokenizer import Tokenizer
from flashmemory.tools.eval import default_text_path


NESTED = "attention_gather"  # part of "attention": blocks decoded to float before the kernel folds them


class Timers:
    """Accumulated seconds per component within the current step (no nesting between components)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, component: str, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[component] += time.perf_counter() - t0
        return timed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--text", type=Path, default=None, help="long text (default: ../shared/data/alice29.txt)")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--setting", action="append", default=[], metavar="KEY=VALUE", help="an engine setting")
    p.add_argument("--kv-snapshot", type=Path, default=None, help="restore the context's KV from this snapshot")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    settings = dict(s.split("=", 1) for s in args.setting)
    engine = FlashMemoryEngine(model_path=args.model, num_threads=args.threads, **settings)
    tokenizer = Tokenizer.from_checkpoint(engine.model_path, engine.model_config.eos_token_ids)
    text = args.text or default_text_path()
    ids = tokenizer.encode(Path(text).read_text(errors="replace"), add_special_tokens=False)
    while len(ids) < args.context + args.steps:
        ids += ids
    timers = Timers()
    linear = F.linear
    F.linear = timers.wrap("weights", linear)
    try:
        from flashmemory.model.linear import QuantizedLinear

        QuantizedLinear.forward = timers.wrap("weights", QuantizedLinear.forward)
    except ImportError:  # a checkout before block-format weights
        pass
    try:  # a decode layer as two native calls: its GEMVs with the norms, RoPE, SwiGLU, residuals
        from flashmemory.model.native.decode_layer import FusedDecodeLayer

        FusedDecodeLayer.pre = timers.wrap("weights", FusedDecodeLayer.pre)
        FusedDecodeLayer.post = timers.wrap("weights", FusedDecodeLayer.post)
    except ImportError:  # a checkout before it
        pass
    cache = engine.cache
    if hasattr(cache, "reader"):
        # choose / decode: the per-sequence calls of checkouts before the batch attention call
        for name in ("choose_batch", "choose", "plan"):
            if hasattr(cache.reader, name):
                setattr(cache.reader, name, timers.wrap("selection", getattr(cache.reader, name)))
        for name in ("decode_batch", "decode"):
            if hasattr(cache.attention, name):
                wrapped = timers.wrap("attention", getattr(cache.attention, name))
                setattr(cache.attention, name, wrapped)
        # Inside attention: reads that are not folded from records in place (the disk level's blocks: read from
        # the file, decoded to float32, then folded), reported as a part of attention, not beside it.
        cache.reader.gather = timers.wrap(NESTED, cache.reader.gather)
    seq_id = engine.core.next_seq_id()
    cache.add_sequence(seq_id)
    restored = 0
    if args.kv_snapshot:
        from flashmemory.engine.kv_snapshot import engine_fingerprint, model_identity, restore_prefill

        restored, _ = restore_prefill(cache, seq_id, ids[: args.context], args.kv_snapshot,
                                      model_identity(engine_fingerprint(engine)), engine.config.prefill_chunk_tokens)
    # Checkouts older than the public forward_tokens (a before/after comparison) call it _forward.
    forward = getattr(engine, "forward_tokens", None) or engine._forward
    forward(seq_id, ids[restored: args.context])
    rows = []
    for pos in range(args.context, args.context + args.steps):
        timers.seconds.clear()
        t0 = time.perf_counter()
        forward(seq_id, [ids[pos]])
        total = time.perf_counter() - t0
        row = {k: v * 1e3 for k, v in timers.seconds.items()}
        row["total"] = total * 1e3
        row["glue"] = row["total"] - sum(v for k, v in row.items() if k not in ("total", NESTED))
        rows.append(row)
    rows = rows[2:]  # the first steps pay one-time costs
    names = ["weights", "attention", NESTED, "selection", "glue", "total"]
    median = {n: statistics.median(r.get(n, 0.0) for r in rows) for n in names}
    result = {"context": args.context, "restored_tokens": restored, "threads": args.threads, "settings": settings,
              "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"), "load_average": os.getloadavg(),
              "median_ms": median}
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    cache.free_sequence(seq_id, keep_cached=False)
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
