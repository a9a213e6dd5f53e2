"""A machine without a compiler (or FLASHMEMORY_NATIVE=0) gets the same answers: for each native kernel (decode
attention, the heat MLP, the access statistics) the torch fallback is what runs, and it is checked against a plain
reference here, and against the kernel where one can be built."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashmemory import FlashMemoryEngine
from flashmemory.kvcache import native
from flashmemory.kvcache.prefetch.access_stats import (
    COLUMN,
    EMA_DECAY,
    NEVER_SELECTED_STEPS,
    NUM_INTERVALS,
    AccessStats,
    StepChoices,
)
from flashmemory.kvcache.prefetch.access_trace import lru_scores
from flashmemory.kvcache.prefetch.heat_predictor import ELIGIBLE_EMA, ELIGIBLE_MARGIN, HeatPredictor

KERNEL_BUILT = native.library() is not None
LEVELS = dict(block_size=8, active_window=16, warm_tokens=16, prefill_chunk_tokens=24, cpu_memory_gb=0.01,
              cold_zone_gb=0.01, semantic_truncate_threshold=0.5, warm_budget_tokens=8)


@pytest.fixture
def no_native(monkeypatch):
    """FLASHMEMORY_NATIVE=0 for objects built inside the test (the loader's cached answer is reset around it)."""
    monkeypatch.setenv("FLASHMEMORY_NATIVE", "0")
    native.library.cache_clear()
    yield
    monkeypatch.delenv("FLASHMEMORY_NATIVE")
    native.library.cache_clear()


def _decode_logits(tiny_llama, ids: list[int], **knobs) -> tuple[torch.Tensor, str]:
    engine = FlashMemoryEngine(model_path=str(tiny_llama), **{**LEVELS, **knobs})
    seq = 3
    engine.cache.add_sequence(seq)
    engine.forward_tokens(seq, ids[:80])
    logits = torch.cat([engine.forward_tokens(seq, [t]) for t in ids[80:]])
    assert engine.stats()["bytes_moved_L1->L2"] > 0  # every level was read while decoding
    backend = engine.cache.attention.name
    engine.close()
    return logits, backend


@pytest.fixture(scope="module")
def ids() -> list[int]:
    return torch.randint(3, 300, (110,), generator=torch.Generator().manual_seed(4)).tolist()


# ---- decode attention ------------------------------------------------------------------------------------------

def test_without_the_kernel_decode_runs_in_torch_and_is_exact_over_three_levels(tiny_llama, ids, no_native):
    tiered, backend = _decode_logits(tiny_llama, ids, kv_precision="fp16", selection="exact")
    assert backend == "torch"
    exact = FlashMemoryEngine(model_path=str(tiny_llama), kv_cache="contiguous", kv_precision="fp16")
    exact.cache.add_sequence(0)
    exact.forward_tokens(0, ids[:80])
    reference = torch.cat([exact.forward_tokens(0, [t]) for t in ids[80:]])
    assert (tiered - reference).abs().max().item() <= 1e-4


@pytest.mark.skipif(not KERNEL_BUILT, reason="no C compiler: the kernel cannot be built here")
def test_decode_with_and_without_the_kernel_gives_the_same_logits_with_prefetch(tiny_llama, ids, monkeypatch):
    knobs = dict(prefetch_strategy="adaptive")  # the access statistics and heat MLP run too
    with_kernel, backend = _decode_logits(tiny_llama, ids, **knobs)
    assert backend == "native"
    monkeypatch.setenv("FLASHMEMORY_NATIVE", "0")
    native.library.cache_clear()
    try:
        without, backend = _decode_logits(tiny_llama, ids, **knobs)
    finally:
        monkeypatch.delenv("FLASHMEMORY_NATIVE")
        native.library.cache_clear()
    assert backend == "torch"
    torch.testing.assert_close(with_kernel, without, rtol=1e-4, atol=1e-4)


# ---- the heat MLP ----------------------------------------------------------------------------------------------

def _mlp_reference(predictor: HeatPredictor, x: np.ndarray) -> np.ndarray:
    """The ranking in numpy: the MLP's logit where a row can be hot, its LRU order far below elsewhere."""
    w = predictor.w
    h = np.maximum((x.T - w["mean"]) / w["std"] @ w["w1"] + w["b1"], 0)
    h = np.maximum(h @ w["w2"] + w["b2"], 0)
    logits = (h @ w["w3"] + w["b3"])[:, 0]
    eligible = (x[COLUMN["score_margin"]] > ELIGIBLE_MARGIN) | (x[COLUMN["ema"]] > ELIGIBLE_EMA)
    return np.where(eligible, logits, lru_scores(x.T) - 100.0)


def _feature_rows(predictor: HeatPredictor, rows: int) -> np.ndarray:
    spread = np.random.default_rng(2).normal(size=(len(predictor.w["mean"]), rows)).astype(np.float32)
    return np.ascontiguousarray(predictor.w["mean"][:, None] + predictor.w["std"][:, None] * spread)


def test_without_the_kernel_the_heat_mlp_ranks_as_the_numpy_reference(no_native):
    predictor = HeatPredictor.load()
    assert predictor._lib is None  # the torch path
    x = _feature_rows(predictor, 777)
    np.testing.assert_allclose(predictor.rank(torch.from_numpy(x)).numpy(), _mlp_reference(predictor, x),
                               rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not KERNEL_BUILT, reason="no C compiler: the kernel cannot be built here")
def test_the_heat_mlp_kernel_ranks_as_the_numpy_reference():
    predictor = HeatPredictor.load()
    assert predictor._lib is not None
    x = _feature_rows(predictor, 777)
    np.testing.assert_allclose(predictor.rank(torch.from_numpy(x)).numpy(), _mlp_reference(predictor, x),
                               rtol=1e-3, atol=1e-3)


# ---- the access statistics -------------------------------------------------------------------------------------

class PlainStats:
    """The statistics of one (layer, KV head) per block, computed one block at a time in plain Python."""

    def __init__(self) -> None:
        self.last: dict[int, int] = {}
        self.count: dict[int, int] = {}
        self.observed: dict[int, int] = {}
        self.ema: dict[int, float] = {}
        self.intervals: dict[int, list[int]] = {}

    def update(self, step: int, candidates: list[int], chosen: set[int]) -> None:
        for block in candidates:
            self.observed[block] = self.observed.get(block, 0) + 1
            self.ema[block] = self.ema.get(block, 0.0) * EMA_DECAY + ((1 - EMA_DECAY) if block in chosen else 0.0)
        for block in chosen:
            if block in self.last:
                self.intervals.setdefault(block, []).append(step - self.last[block])
            self.last[block] = step
            self.count[block] = self.count.get(block, 0) + 1

    def row(self, step: int, block: int) -> dict[str, float]:
        since = step - self.last[block] if block in self.last else NEVER_SELECTED_STEPS
        kept = np.array(self.intervals.get(block, [])[-NUM_INTERVALS:], dtype=np.float64)
        mean = kept.mean() if len(kept) else 0.0
        return {"recency_log": np.log1p(since) / 5, "never_selected": float(block not in self.last),
                "selected_now": float(self.last.get(block) == step),
                "frequency": self.count.get(block, 0) / max(self.observed.get(block, 0), 1),
                "ema": self.ema.get(block, 0.0), "interval_mean_log": np.log1p(mean) / 5,
                "interval_var_log": np.log1p(kept.var() if len(kept) else 0.0) / 10,
                "num_intervals": len(kept) / NUM_INTERVALS}


def _check_against_plain(stats: AccessStats) -> None:
    rng = np.random.default_rng(11)
    layers, heads, budget = stats.num_layers, stats.num_kv_heads, 5
    plain = {(layer, head): PlainStats() for layer in range(layers) for head in range(heads)}
    for step in range(40):  # long enough for the interval rings to wrap; the candidates grow as a sequence does
        n = 20 + step // 4
        ids = torch.arange(3, 3 + n)
        scores = torch.from_numpy(rng.normal(size=(layers, heads, n)).astype(np.float32))
        chosen = scores.topk(budget, dim=-1).indices
        c = StepChoices(100 + step, 2, torch.arange(layers), ids, scores, chosen, torch.zeros(layers, heads), 60)
        stats.update(c)
        features = stats.features(c)
        for (layer, head), reference in plain.items():
            picked = {int(ids[j]) for j in chosen[layer, head]}
            reference.update(100 + step, ids.tolist(), picked)
            for j, block in enumerate(ids.tolist()):
                for name, value in reference.row(100 + step, block).items():
                    got = float(features[COLUMN[name], layer, head, j])
                    assert got == pytest.approx(value, abs=1e-5), (name, step, layer, head, block)


def test_without_the_kernel_the_access_statistics_equal_a_plain_computation(no_native):
    stats = AccessStats(3, 2)
    assert stats._lib is None  # the torch reference path
    _check_against_plain(stats)


@pytest.mark.skipif(not KERNEL_BUILT, reason="no C compiler: the kernel cannot be built here")
def test_the_access_statistics_kernel_equals_a_plain_computation():
    stats = AccessStats(3, 2)
    assert stats._lib is not None
    _check_against_plain(stats)
