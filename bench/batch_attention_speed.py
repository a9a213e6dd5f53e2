"""One layer's decode attention for 1, 4 and 8 sequences of 2K tokens (SmolLM2's heads; the
engine's window, recent FP16 rows and sink): the native backend's batch call (decode_batch, one C
call) against the per-sequence DecodeState calls it made before issue 25, interleaved in one
process on the same DecodeBatch, the outputs checked equal bit for bit; median microseconds per
layer call.

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. .venv/bin/python bench/batch_attention_speed.py \
        --rounds 300
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from flashmemory.kvcache import native
from flashmemory.kvcache.config import TieredCacheConfig
from flashmemory.kvcache.interface import ForwardBatch
from flashmemory.kvcache.manager.blocks import Level
from flashmemory.kvcache.tiered import TieredKVCache

HEADS, KV_HEADS, DIM, CONTEXT = 9, 3, 64, 2048


def old_decode(backend, batch, reader, states):
    """The native backend's decode before issue 25, one sequence at a time (with the interface's
    loop over the sequences)."""
    out = torch.empty_like(batch.q)
    for b, seq in enumerate(batch.seqs):
        q = batch.q[b : b + 1]
        key = (q.shape[1], KV_HEADS, DIM)
        if key not in states:
            states[key] = native.DecodeState(native.library(), q[0], KV_HEADS)
        state = states[key]
        state.reset(q[0])
        state.add_dense(seq.row[0], seq.row[1])
        state.add_dense(seq.new_k, seq.new_v)
        for read in seq.reads:
            pool = reader.memory_pool(read.level)
            if read.chosen is None:
                state.add_records(pool.storage, read.plan.slot_tensor.expand(KV_HEADS, -1),
                                  backend._format(pool), layer=batch.layer)
            else:
                state.add_records(pool.storage, read.chosen, backend._format(pool),
                                  table=read.plan.slot_tensor, layer=batch.layer)
        out[b : b + 1] = state.output().unsqueeze(0)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=200, help="timed calls of each path")
    rounds = p.parse_args().rounds
    torch.manual_seed(0)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for batch_size in (1, 4, 8):
            cfg = TieredCacheConfig(1, KV_HEADS, DIM, device_slots=8 * 132, host_slots=8 * 132,
                                    disk_slots=16, block_size=16, active_window=2048,
                                    warm_tokens=16384, max_num_seqs=8, recent_fp16_tokens=128,
                                    cold_zone_dir=tmp)
            cache = TieredKVCache(cfg)
            assert cache.attention.name == "native"
            for s in range(batch_size):
                cache.add_sequence(s)
                keys = torch.randn(1, KV_HEADS, CONTEXT, DIM) + torch.randn(1, KV_HEADS, 1, DIM)
                cache.append_kv(s, keys, torch.randn(1, KV_HEADS, CONTEXT, DIM),
                                list(range(s * CONTEXT, (s + 1) * CONTEXT)))
            slices = ForwardBatch.build([(s, CONTEXT, 1) for s in range(batch_size)],
                                        torch.device("cpu")).slices
            q = torch.randn(batch_size, HEADS, DIM)
            k, v = torch.randn(batch_size, KV_HEADS, DIM), torch.randn(batch_size, KV_HEADS, DIM)
            batch = cache.planner.decode_batch(0, list(slices), q, k, v)
            assert [r.level for r in batch.seqs[0].reads] == [Level.DEVICE]
            states = {}
            new = cache.attention.decode_batch(batch, cache.reader)
            assert torch.equal(new, old_decode(cache.attention, batch, cache.reader, states))
            times = {"per-sequence": [], "batch": []}
            for _ in range(rounds):
                for name in times:
                    started = time.perf_counter()
                    if name == "batch":
                        cache.attention.decode_batch(batch, cache.reader)
                    else:
                        old_decode(cache.attention, batch, cache.reader, states)
                    times[name].append(time.perf_counter() - started)
            results[batch_size] = {n: statistics.median(t) * 1e6 for n, t in times.items()}
            cache.close()
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"threads {torch.get_num_threads()}, rounds {rounds}, load average {load}")
    print("| sequences | per-sequence calls, us | one batch call, us | gain |")
    print("|---:|---:|---:|---:|")
    for b, r in results.items():
        print(f"| {b} | {r['per-sequence']:.0f} | {r['batch']:.0f} | "
              f"{r['per-sequence'] / r['batch']:.2f}x |")


if __name__ == "__main__":
    main()
