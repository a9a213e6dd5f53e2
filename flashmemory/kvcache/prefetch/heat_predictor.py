"""Heat predictor: a 3-layer MLP (529 parameters as shipped: 14 -> 16 -> 16 -> 1) that ranks blocks by the chance a coming step selects them.

Input: the feature rows of access_trace.AccessStats (recency, frequency, digest score rank and margin, level,
interval statistics, query mean). Output: P(the block is chosen by the same layer and KV head at the next step).
Inference runs once per decode step over every layer's candidates, on the CPU, through the native kernel
csrc/heat_mlp.c (fused, nothing allocated; the feature normalization folded into the first layer) or, without a
compiler, three torch matmuls. Training is run offline by `flashmemory train-predictor`. The trained weights ship
next to this file and are loaded by default.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from flashmemory.errors import ConfigError
from flashmemory.kvcache import native
from flashmemory.kvcache.prefetch.access_stats import COLUMN, FEATURE_NAMES, NUM_FEATURES
from flashmemory.kvcache.prefetch.access_trace import lru_scores

DEFAULT_WEIGHTS = Path(__file__).with_name("heat_predictor.npz")
HIDDEN = 16  # units of both hidden layers (default of train_heat_predictor)
MAX_PARAMETERS = 50_000
_NAMES = ("w1", "b1", "w2", "b2", "w3", "b3", "mean", "std")
FEATURES_KEY = "feature_names"  # the feature columns a weights file was trained on
# Rows the MLP scores: a block within ELIGIBLE_MARGIN score stds of this step's budget line, or selected lately
# (EMA above ELIGIBLE_EMA). The others cannot be among the hottest (on held-out traces the filter keeps ~half the
# rows and ~99 % of the blocks the next step selects, and leaves precision/recall at the budget unchanged); they
# rank below every eligible row, in LRU order (access_trace.lru_scores).
ELIGIBLE_MARGIN = -1.0
ELIGIBLE_EMA = 0.05
_BELOW = -100.0  # offset of ineligible rows' LRU scores (in [-2, 0]); the MLP's logits on real rows stay within +-30


def eligible_rows(features: torch.Tensor) -> torch.Tensor:
    """Which feature-major rows [NUM_FEATURES, rows] the MLP ranks (the C kernel applies the same rule)."""
    return (features[COLUMN["score_margin"]] > ELIGIBLE_MARGIN) | (features[COLUMN["ema"]] > ELIGIBLE_EMA)


class HeatPredictor:
    """Owns the MLP's weights and the feature normalization; scores feature rows."""

    def __init__(self, weights: dict[str, np.ndarray]) -> None:
        missing = [n for n in _NAMES if n not in weights]
        if missing:
            raise ConfigError(f"heat predictor weights lack {', '.join(missing)}; retrain with "
                              "`flashmemory train-predictor`")
        trained_on = tuple(str(n) for n in weights.get(FEATURES_KEY, ()))
        if trained_on != FEATURE_NAMES:
            got = list(trained_on) if trained_on else "of an older version"
            raise ConfigError(f"heat predictor weights were trained on features {got}, this version computes "
                              f"{list(FEATURE_NAMES)}; retrain with `flashmemory train-predictor`")
        self.w = {n: np.asarray(weights[n], dtype=np.float32) for n in _NAMES}
        self._t = {n: torch.from_numpy(a) for n, a in self.w.items()}
        if self.w["w1"].shape[0] != NUM_FEATURES:
            raise ConfigError(f"heat predictor weights expect {self.w['w1'].shape[0]} features, this version "
                              f"computes {NUM_FEATURES}; retrain with `flashmemory train-predictor`")
        if self.num_parameters > MAX_PARAMETERS:
            raise ConfigError(f"heat predictor has {self.num_parameters} parameters (limit {MAX_PARAMETERS})")
        hidden = self.w["w2"].shape[0]
        self._lib = native.library() if hidden % 8 == 0 and hidden <= native.MLP_MAX_HIDDEN else None
        # For the kernel: (x - mean) / std @ w1 + b1 == x @ (w1 / std) + (b1 - (mean / std) @ w1).
        w1 = self.w["w1"] / self.w["std"][:, None]
        b1 = self.w["b1"] - (self.w["mean"] / self.w["std"]) @ self.w["w1"]
        self._folded = [np.ascontiguousarray(a, dtype=np.float32) for a in (w1, b1, self.w["w2"], self.w["b2"],
                                                                              self.w["w3"][:, 0])]

    @property
    def num_parameters(self) -> int:
        return sum(self.w[n].size for n in _NAMES[:6])

    def rank(self, features: torch.Tensor) -> torch.Tensor:
        """Ranking scores [rows] for feature-major rows [NUM_FEATURES, rows]: the MLP's logit for eligible rows,
        far below them (in recency/LRU order) for the rest, which the MLP does not run on."""
        return torch.from_numpy(self._run(features, eligible_only=True))

    def logits(self, features: np.ndarray | torch.Tensor) -> np.ndarray:
        """features [rows, NUM_FEATURES] -> logits [rows] (higher = hotter), every row through the MLP."""
        return self._run(torch.as_tensor(features, dtype=torch.float32).T, eligible_only=False)

    def _run(self, features: torch.Tensor, eligible_only: bool) -> np.ndarray:
        x = features.to(torch.float32).contiguous()  # [NUM_FEATURES, rows]
        if self._lib is not None:
            out = np.empty(x.shape[1], dtype=np.float32)
            w1, b1, w2, b2, w3 = self._folded
            ptr = ctypes.c_void_p
            margin = COLUMN["score_margin"] if eligible_only else -1
            rc = self._lib.fm_heat_rank(
                ptr(x.data_ptr()), x.shape[1], x.shape[0], w1.ctypes.data_as(ptr), b1.ctypes.data_as(ptr),
                w2.ctypes.data_as(ptr), b2.ctypes.data_as(ptr), w3.ctypes.data_as(ptr), float(self.w["b3"][0]),
                w2.shape[0], margin, ELIGIBLE_MARGIN, COLUMN["ema"], ELIGIBLE_EMA, COLUMN["recency_log"],
                COLUMN["frequency"], _BELOW, out.ctypes.data_as(ptr))
            if rc == 0:
                return out
        w = self._t
        with torch.inference_mode():
            h = (x.T - w["mean"]) / w["std"]
            h = torch.relu(torch.addmm(w["b1"], h, w["w1"]))
            h = torch.relu(torch.addmm(w["b2"], h, w["w2"]))
            logits = torch.addmm(w["b3"], h, w["w3"])[:, 0]
            if eligible_only:
                logits = torch.where(eligible_rows(x), logits, lru_scores(x.T) + _BELOW)
            return logits.numpy()

    def predict(self, features: np.ndarray) -> np.ndarray:
        """P(selected at the next step) per row."""
        return 1 / (1 + np.exp(-np.clip(self.logits(features), -30, 30)))

    def save(self, path: str | Path) -> None:
        np.savez(path, **self.w, **{FEATURES_KEY: np.array(FEATURE_NAMES)})

    @classmethod
    def load(cls, path: str | Path | None = None) -> "HeatPredictor":
        """The weights at `path`, or the ones shipped in the package when None."""
        path = DEFAULT_WEIGHTS if path is None else Path(path)
        try:
            with np.load(path) as data:
                weights = {n: data[n] for n in data.files}
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read heat predictor weights {str(path)!r} ({e}); set heat_predictor_path "
                              "to a file written by `flashmemory train-predictor`") from e
        return cls(weights)


def train_heat_predictor(features: np.ndarray, labels: np.ndarray, epochs: int = 3, batch_rows: int = 4096,
                         learning_rate: float = 3e-3, max_rows: int = 2_000_000, seed: int = 0,
                         hidden: int = HIDDEN) -> HeatPredictor:
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
    model = torch.nn.Sequential(torch.nn.Linear(NUM_FEATURES, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                                torch.nn.ReLU(), torch.nn.Linear(hidden, 1))
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
    weights[FEATURES_KEY] = np.array(FEATURE_NAMES)
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
    scores = predictor.rank(torch.from_numpy(np.ascontiguousarray(features.T))).numpy()
    per_row_us = (time.perf_counter() - started) / max(len(features), 1) * 1e6
    keep = features[:, FEATURE_NAMES.index("budget_fraction")]
    ours = ranking_quality(scores, labels, groups, keep)
    lru = ranking_quality(lru_scores(features), labels, groups, keep)
    return {"predictor_precision": ours.precision, "predictor_recall": ours.recall, "lru_precision": lru.precision,
            "lru_recall": lru.recall, "num_choices": ours.num_choices, "predictor_us_per_row": per_row_us}
