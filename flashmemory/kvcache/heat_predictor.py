"""Heat predictor: a 3-layer MLP (~1.6K parameters) that ranks blocks by the chance a coming step selects them.

Input: the feature rows of access_trace.AccessStats (recency, frequency, digest score rank and margin, level,
interval statistics, query mean). Output: P(the block is chosen by the same layer and KV head at the next step).
Inference is three small matmuls on the CPU per layer (torch, whose thread count the engine sets: numpy's BLAS
would start its own thread pool, which on a busy machine costs milliseconds); training is run offline by
`flashmemory train-predictor`. The trained weights ship next to this file and are loaded by default.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from flashmemory.errors import ConfigError
from flashmemory.kvcache.access_trace import FEATURE_NAMES, NUM_FEATURES, lru_scores

DEFAULT_WEIGHTS = Path(__file__).with_name("heat_predictor.npz")
HIDDEN = 32  # units of both hidden layers
MAX_PARAMETERS = 50_000
_NAMES = ("w1", "b1", "w2", "b2", "w3", "b3", "mean", "std")


class HeatPredictor:
    """Owns the MLP's weights and the feature normalization; scores feature rows."""

    def __init__(self, weights: dict[str, np.ndarray]) -> None:
        missing = [n for n in _NAMES if n not in weights]
        if missing:
            raise ConfigError(f"heat predictor weights lack {', '.join(missing)}; retrain with "
                              "`flashmemory train-predictor`")
        self.w = {n: np.asarray(weights[n], dtype=np.float32) for n in _NAMES}
        self._t = {n: torch.from_numpy(a) for n, a in self.w.items()}
        if self.w["w1"].shape[0] != NUM_FEATURES:
            raise ConfigError(f"heat predictor weights expect {self.w['w1'].shape[0]} features, this version "
                              f"computes {NUM_FEATURES}; retrain with `flashmemory train-predictor`")
        if self.num_parameters > MAX_PARAMETERS:
            raise ConfigError(f"heat predictor has {self.num_parameters} parameters (limit {MAX_PARAMETERS})")

    @property
    def num_parameters(self) -> int:
        return sum(self.w[n].size for n in _NAMES[:6])

    def logits(self, features: np.ndarray) -> np.ndarray:
        """features [rows, NUM_FEATURES] -> logits [rows] (higher = hotter)."""
        w = self._t
        with torch.inference_mode():
            x = (torch.from_numpy(np.ascontiguousarray(features, dtype=np.float32)) - w["mean"]) / w["std"]
            h = torch.relu(torch.addmm(w["b1"], x, w["w1"]))
            h = torch.relu(torch.addmm(w["b2"], h, w["w2"]))
            return torch.addmm(w["b3"], h, w["w3"])[:, 0].numpy()

    def predict(self, features: np.ndarray) -> np.ndarray:
        """P(selected at the next step) per row."""
        return 1 / (1 + np.exp(-np.clip(self.logits(features), -30, 30)))

    def save(self, path: str | Path) -> None:
        np.savez(path, **self.w)

    @classmethod
    def load(cls, path: str | Path | None = None) -> "HeatPredictor":
        """The weights at `path`, or the ones shipped in the package when None."""
        path = DEFAULT_WEIGHTS if path is None else Path(path)
        try:
            with np.load(path) as data:
                return cls({n: data[n] for n in data.files})
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read heat predictor weights {str(path)!r} ({e}); set heat_predictor_path "
                              "to a file written by `flashmemory train-predictor`") from e


def train_heat_predictor(features: np.ndarray, labels: np.ndarray, epochs: int = 3, batch_rows: int = 4096,
                         learning_rate: float = 3e-3, max_rows: int = 2_000_000, seed: int = 0) -> HeatPredictor:
    """Fit the MLP with binary cross-entropy (torch, CPU)."""
    rng = np.random.default_rng(seed)
    if len(features) > max_rows:
        keep = rng.choice(len(features), max_rows, replace=False)
        features, labels = features[keep], labels[keep]
    mean = features.mean(0)
    std = features.std(0) + 1e-3
    x = torch.from_numpy((features - mean) / std).float()
    y = torch.from_numpy(labels).float()
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(NUM_FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN),
                                torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 1))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / max(p.shape[-1], 1)) ** 0.5)
    opt = torch.optim.Adam(model.parameters(), lr=learning_rate)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=gen)
        for start in range(0, len(x), batch_rows):
            rows = order[start : start + batch_rows]
            loss = loss_fn(model(x[rows])[:, 0], y[rows])
            opt.zero_grad()
            loss.backward()
            opt.step()
    layers = [m for m in model if isinstance(m, torch.nn.Linear)]
    weights = {}
    for i, layer in enumerate(layers, start=1):
        weights[f"w{i}"] = layer.weight.detach().numpy().T.copy()
        weights[f"b{i}"] = layer.bias.detach().numpy().copy()
    weights["mean"], weights["std"] = mean.astype(np.float32), std.astype(np.float32)
    return HeatPredictor(weights)


@dataclass
class RankingQuality:
    """How well a ranking picks each choice's next-step blocks, when it keeps as many blocks as a step selects."""

    precision: float  # kept blocks that were selected / kept
    recall: float  # selected blocks that were kept / selected
    num_choices: int


def ranking_quality(scores: np.ndarray, labels: np.ndarray, groups: np.ndarray,
                    keep_fraction: np.ndarray) -> RankingQuality:
    """Per group (one layer, KV head and step), keep the top-b rows by score, b = keep_fraction x group size
    (the selection budget of that step, so the kept set is as large as what a step reads)."""
    order = np.lexsort((-scores, groups))
    g = groups[order]
    bounds = np.flatnonzero(np.diff(g)) + 1
    kept = selected = hits = 0.0
    for part in np.split(np.arange(len(g)), bounds):
        rows = order[part]
        want = labels[rows]
        b = max(int(round(float(keep_fraction[rows[0]]) * len(rows))), 1)
        hits += want[:b].sum()
        kept += b
        selected += want.sum()
    return RankingQuality(float(hits / max(kept, 1)), float(hits / max(selected, 1)), len(bounds) + 1)


def compare_with_lru(predictor: HeatPredictor, features: np.ndarray, labels: np.ndarray,
                     groups: np.ndarray) -> dict[str, float]:
    """Precision / recall of the predictor and of the recency/LRU baseline on the same rows, and latency."""
    started = time.perf_counter()
    scores = predictor.logits(features)
    per_row_us = (time.perf_counter() - started) / max(len(features), 1) * 1e6
    keep = features[:, FEATURE_NAMES.index("budget_fraction")]
    ours = ranking_quality(scores, labels, groups, keep)
    lru = ranking_quality(lru_scores(features), labels, groups, keep)
    return {"predictor_precision": ours.precision, "predictor_recall": ours.recall, "lru_precision": lru.precision,
            "lru_recall": lru.recall, "num_choices": ours.num_choices, "predictor_us_per_row": per_row_us}
