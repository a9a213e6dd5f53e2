"""`flashmemory trace` / `train-predictor` helpers: windows of a text, training from saved traces."""

from __future__ import annotations

import json

import numpy as np
import pytest

from flashmemory.cli import main
from flashmemory.errors import ConfigError
from flashmemory.kvcache.prefetch.access_trace import ChoiceEvent, TraceRecorder
from flashmemory.kvcache.prefetch.heat_predictor import HeatPredictor
from flashmemory.tools.access_traces import text_windows


def test_windows_are_evenly_spaced_and_a_short_text_is_refused():
    windows = text_windows(list(range(100)), context_tokens=30, decode_steps=10, num_windows=3)
    assert [w[0] for w in windows] == [0, 30, 60] and all(len(w) == 40 for w in windows)
    with pytest.raises(ConfigError, match="longer text"):
        text_windows(list(range(10)), 30, 10, 1)


def _trace(seed: int) -> TraceRecorder:
    """A block stays hot for a few steps after its score crosses the budget line: recency alone lags it."""
    rng = np.random.default_rng(seed)
    trace = TraceRecorder()
    scores = rng.random((1, 12))
    for step in range(60):
        scores = 0.7 * scores + 0.3 * rng.random((1, 12))
        chosen = np.sort(np.argsort(-scores, axis=1)[:, :3], axis=1).astype(np.int32)
        trace.events.append(ChoiceEvent(0, step, 0, 2, np.arange(12, dtype=np.int32), scores.astype(np.float16), chosen,
                                        np.zeros(1, np.float32), 16))
    return trace


def test_train_predictor_command_writes_loadable_weights_and_compares_with_lru(tmp_path, capsys):
    _trace(0).save(tmp_path / "a.npz")
    _trace(1).save(tmp_path / "b.npz")
    out = tmp_path / "w.npz"
    assert main(["train-predictor", str(tmp_path / "a.npz"), "--held-out", str(tmp_path / "b.npz"), "--out",
                 str(out), "--epochs", "5"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert {"predictor_precision", "predictor_recall", "lru_precision", "lru_recall"} <= set(figures)
    assert HeatPredictor.load(out).num_parameters == figures["num_parameters"] <= 50_000
