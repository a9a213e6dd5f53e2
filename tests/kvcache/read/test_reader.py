"""BlockReader's two-pass read (selection_rescore_factor): the bounds pick more candidates than
the budget, their FP16 keys pick the budget; counted as keys read, and closer to exact attention
than the bounds alone at the same budget."""

from __future__ import annotations

import torch

from flashmemory.kvcache.tiered import TieredKVCache
from tests.kvcache.synthetic import SyntheticSequence, tiny_config

# Everything old stays in FP16 L1 (no L2), and a decode step attends 2 of its blocks.
ONLY_L1 = dict(kv_precision="fp16", warm_tokens=4096, warm_budget_tokens=16,
               warm_budget_fraction=1.0, selection_min_tokens=0, selection_prompt_tokens=0,
               host_slots=64)


def _decode_error(tmp_path, factor: float) -> tuple[float, dict]:
    cache = TieredKVCache(tiny_config(cold_zone_dir=str(tmp_path / str(factor)),
                                      selection_rescore_factor=factor, **ONLY_L1))
    seq = SyntheticSequence(1, 240, seed=5)
    seq.q *= 6  # peaked attention, as a model's: a few blocks hold most of a query's weight
    cache.add_sequence(1)
    for start in range(0, 192, 32):
        seq.forward(cache, start, start + 32)
    errors = []
    for t in range(192, 240):
        out = seq.forward(cache, t, t + 1).double()
        errors.append((out - seq.reference(t, t + 1)).abs().mean().item())
    stats = cache.stats()
    cache.close()
    return sum(errors) / len(errors), stats


def test_the_second_pass_reads_twice_the_keys_and_attends_closer_to_exact(tmp_path):
    alone, plain = _decode_error(tmp_path, 1.0)
    rescored, two_pass = _decode_error(tmp_path, 2.0)
    assert plain["L1_selected_fraction"] == two_pass["L1_selected_fraction"]  # the same budget
    assert plain["selection_old_keys_read_fraction"] == plain["selection_old_read_fraction"]
    keys = two_pass["selection_old_keys_read_fraction"]
    read = two_pass["selection_old_read_fraction"]
    assert abs(keys - 2 * read) < 1e-9
    assert rescored < 0.9 * alone
