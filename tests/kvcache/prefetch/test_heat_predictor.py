"""Heat predictor: small, fast, shipped; learns from traces; bad weight files fail with a clear message."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashmemory.errors import ConfigError
from flashmemory.kvcache import native
from flashmemory.kvcache.prefetch.access_stats import COLUMN, FEATURE_NAMES, NUM_FEATURES
from flashmemory.kvcache.prefetch.access_trace import lru_scores
from flashmemory.kvcache.prefetch.heat_predictor import (
    ELIGIBLE_EMA,
    ELIGIBLE_MARGIN,
    MAX_PARAMETERS,
    HeatPredictor,
    compare_with_lru,
    ranking_quality,
    train_heat_predictor,
)


def test_shipped_predictor_is_small_and_knows_its_features():
    predictor = HeatPredictor.load()  # the weights in the package
    assert predictor.num_parameters <= MAX_PARAMETERS and len([k for k in predictor.w if k.startswith("w")]) == 3
    rows = np.random.default_rng(0).random((3 * 256, NUM_FEATURES), dtype=np.float32)  # 3 KV heads x 256 blocks
    p = predictor.predict(rows)
    assert p.shape == (768,) and np.all((p >= 0) & (p <= 1))


@pytest.mark.skipif(native.library() is None, reason="no C compiler: the kernel cannot be built here")
def test_rank_kernel_equals_torch_and_skips_only_blocks_that_cannot_be_hot():
    predictor = HeatPredictor.load()
    rng = np.random.default_rng(1)
    spread = rng.normal(size=(NUM_FEATURES, 1001)).astype(np.float32)  # rows: not a multiple of 8
    x = torch.from_numpy(predictor.w["mean"][:, None] + predictor.w["std"][:, None] * spread)
    x[COLUMN["score_margin"], ::3] = ELIGIBLE_MARGIN - 1  # a third far below the budget line ...
    x[COLUMN["ema"], ::6] = ELIGIBLE_EMA + 0.1  # ... half of them selected lately (eligible again)
    eligible = (x[COLUMN["score_margin"]] > ELIGIBLE_MARGIN) | (x[COLUMN["ema"]] > ELIGIBLE_EMA)
    fast_rank, fast_logits = predictor.rank(x), predictor.logits(x.T)
    predictor._lib = None  # the pure-torch path
    slow_rank, slow_logits = predictor.rank(x), predictor.logits(x.T)
    assert np.allclose(fast_logits, slow_logits, atol=1e-3) and torch.allclose(fast_rank, slow_rank, atol=1e-3)
    assert torch.allclose(fast_rank[eligible], torch.from_numpy(slow_logits)[eligible], atol=1e-3)
    assert fast_rank[~eligible].max() < fast_rank[eligible].min()  # every skipped block ranks below, ...
    assert torch.allclose(fast_rank[~eligible], lru_scores(x.T)[~eligible] - 100, atol=1e-4)  # ... in LRU order


def test_weights_trained_on_other_features_are_refused(tmp_path):
    weights = dict(np.load(HeatPredictor.load.__globals__["DEFAULT_WEIGHTS"]))
    weights["feature_names"] = np.array([*FEATURE_NAMES[:-1], "something_else"])
    np.savez(tmp_path / "old.npz", **weights)
    with pytest.raises(ConfigError, match="retrain with `flashmemory train-predictor`"):
        HeatPredictor.load(tmp_path / "old.npz")


def _synthetic(n_groups: int, seed: int):
    """Choices of 20 candidates where the next step picks the 4 blocks with the best score margin."""
    rng = np.random.default_rng(seed)
    x = rng.random((n_groups * 20, NUM_FEATURES), dtype=np.float32)
    x[:, FEATURE_NAMES.index("budget_fraction")] = 0.2
    groups = np.repeat(np.arange(n_groups), 20)
    margin = x[:, FEATURE_NAMES.index("score_margin")].reshape(n_groups, 20)
    y = np.zeros_like(margin)
    np.put_along_axis(y, np.argsort(-margin, axis=1)[:, :4], 1, axis=1)
    return x, y.reshape(-1), groups


def test_training_learns_what_recency_cannot_see():
    x, y, g = _synthetic(400, 0)
    predictor = train_heat_predictor(x, y, epochs=20, batch_rows=512, learning_rate=1e-2)
    hx, hy, hg = _synthetic(200, 1)
    figures = compare_with_lru(predictor, hx, hy, hg)
    assert figures["predictor_precision"] > 0.8 > 0.4 > figures["lru_precision"]
    assert figures["predictor_recall"] == pytest.approx(figures["predictor_precision"])  # 4 kept, 4 chosen


def test_ranking_quality_counts_the_top_budget_per_choice():
    scores = np.array([3, 2, 1, 0, 9, 8, 7, 6], np.float32)
    labels = np.array([1, 0, 1, 0, 0, 0, 0, 1], np.float32)
    groups = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    q = ranking_quality(scores, labels, groups, np.full(8, 0.5, np.float32))  # keep 2 of 4 per choice
    assert q.precision == pytest.approx(1 / 4) and q.recall == pytest.approx(1 / 3) and q.num_choices == 2


def test_bad_weights_file_is_a_config_error(tmp_path):
    bad = tmp_path / "w.npz"
    bad.write_bytes(b"nope")
    with pytest.raises(ConfigError, match="heat_predictor_path"):
        HeatPredictor.load(bad)
    np.savez(tmp_path / "partial.npz", w1=np.zeros((NUM_FEATURES, 4), np.float32))
    with pytest.raises(ConfigError, match="retrain"):
        HeatPredictor.load(tmp_path / "partial.npz")
