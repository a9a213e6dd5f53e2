"""Access traces of query-aware selection and the per-block statistics the heat predictor reads.

At every decode step, for every layer and level, selection scores a level's candidate blocks against the query and
chooses the top ones per KV head. `ChoiceEvent` is one such choice; `TraceRecorder` keeps them (and saves them as
.npz); `AccessStats` folds them, in order, into per-(layer, KV head, block) running statistics and turns those into
the predictor's feature rows. The same `AccessStats` runs online (prefetch) and offline (training from a trace), so
the features a model is trained on are the features it is served.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from flashmemory.errors import ConfigError

NUM_INTERVALS = 10  # access intervals kept per block for the interval statistics
FEATURE_NAMES = (
    "recency_log",  # log1p(steps since last selected) / 5; never selected counts as 64 steps
    "never_selected",
    "selected_now",
    "frequency",  # times selected / times a candidate
    "ema",  # exponential average of "selected" (0.7 decay per step)
    "score_rank",  # rank of the block's digest score among the candidates, 0 = best, 1 = worst
    "score_margin",  # (score - budget-th best score) / std of the scores
    "position",  # logical block index / number of blocks in the sequence
    "level",  # 0 = L1, 1 = L2
    "interval_mean_log",
    "interval_var_log",
    "num_intervals",  # intervals recorded / NUM_INTERVALS
    "query_mean",  # mean of the query heads of this KV head (scaled)
    "budget_fraction",  # blocks chosen / candidates
)
NUM_FEATURES = len(FEATURE_NAMES)


@dataclass
class ChoiceEvent:
    """One query-aware choice: one decode step, one layer, one level, every KV head."""

    seq_id: int
    step: int  # the sequence's position (tokens before the decoded one): one per decode step
    layer: int
    level: int  # 1 = L1 (host), 2 = L2 (disk)
    indices: np.ndarray  # [n] logical block indices of the candidates (int32)
    scores: np.ndarray  # [num_kv_heads, n] Quest upper-bound scores (float16)
    chosen: np.ndarray  # [num_kv_heads, budget] positions into `indices` (int16 / int32)
    query_mean: np.ndarray  # [num_kv_heads] mean of the query heads sharing each KV head (float32)
    num_blocks: int  # full blocks of the sequence at this step (for the position feature)


class TraceRecorder:
    """Owns a list of ChoiceEvents recorded from a live cache; saves and loads them as one .npz file."""

    def __init__(self) -> None:
        self.events: list[ChoiceEvent] = []

    def on_choose(self, event: ChoiceEvent) -> None:
        self.events.append(event)

    def __len__(self) -> int:
        return len(self.events)

    def save(self, path: str | Path) -> None:
        """Write the events to `path` (.npz): flat arrays plus per-event offsets."""
        ev = self.events
        header = np.array([[e.seq_id, e.step, e.layer, e.level, len(e.indices), e.chosen.shape[1], e.num_blocks]
                           for e in ev], dtype=np.int64).reshape(len(ev), 7)
        heads = ev[0].scores.shape[0] if ev else 0
        np.savez_compressed(
            path,
            header=header,
            indices=np.concatenate([e.indices for e in ev]).astype(np.int32) if ev else np.zeros(0, np.int32),
            scores=np.concatenate([e.scores for e in ev], axis=1).astype(np.float16) if ev else np.zeros((0, 0)),
            chosen=np.concatenate([e.chosen for e in ev], axis=1).astype(np.int32) if ev else np.zeros((0, 0)),
            query_mean=np.stack([e.query_mean for e in ev]).astype(np.float32) if ev else np.zeros((0, heads)),
        )

    @classmethod
    def load(cls, path: str | Path) -> "TraceRecorder":
        try:
            data = np.load(path)
            header, indices, scores, chosen, qmean = (data[k] for k in ("header", "indices", "scores", "chosen",
                                                                          "query_mean"))
        except (OSError, KeyError, ValueError) as e:
            raise ConfigError(f"cannot read access trace {str(path)!r} ({e}); record one with `flashmemory trace`") \
                from e
        rec = cls()
        n_off = b_off = 0
        for row, qm in zip(header, qmean):
            seq_id, step, layer, level, n, budget, num_blocks = (int(x) for x in row)
            rec.events.append(ChoiceEvent(seq_id, step, layer, level, indices[n_off : n_off + n],
                                          scores[:, n_off : n_off + n], chosen[:, b_off : b_off + budget], qm,
                                          num_blocks))
            n_off += n
            b_off += budget
        return rec


class AccessStats:
    """Owns running selection statistics per (layer, KV head, logical block) of one sequence; emits feature rows."""

    def __init__(self, num_layers: int, num_kv_heads: int) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self._capacity = 0
        self._grow(256)

    def _grow(self, capacity: int) -> None:
        shape = (self.num_layers, self.num_kv_heads)

        def grown(old: np.ndarray | None, fill: float, dtype, extra: tuple[int, ...] = ()) -> np.ndarray:
            new = np.full(shape + (capacity,) + extra, fill, dtype=dtype)
            if old is not None:
                new[:, :, : old.shape[2]] = old
            return new

        first = self._capacity == 0
        self.last_step = grown(None if first else self.last_step, -1, np.int64)
        self.count = grown(None if first else self.count, 0, np.float32)
        self.observed = grown(None if first else self.observed, 0, np.float32)
        self.ema = grown(None if first else self.ema, 0, np.float32)
        self.intervals = grown(None if first else self.intervals, 0, np.float32, (NUM_INTERVALS,))
        self.num_intervals = grown(None if first else self.num_intervals, 0, np.int64)
        self._capacity = capacity

    def update(self, event: ChoiceEvent) -> None:
        """Fold one choice into the statistics of its layer's candidates."""
        idx = event.indices.astype(np.int64)
        if idx.size == 0:
            return
        if idx.max() >= self._capacity:
            self._grow(max(2 * self._capacity, int(idx.max()) + 1))
        layer = event.layer
        heads = self.num_kv_heads
        selected = np.zeros((heads, idx.size), dtype=bool)  # [heads, n]
        np.put_along_axis(selected, event.chosen.astype(np.int64), True, axis=1)
        last = self.last_step[layer][:, idx]  # [heads, n]
        new_interval = selected & (last >= 0)
        if new_interval.any():
            h, j = np.nonzero(new_interval)
            b = idx[j]
            ring = self.intervals[layer]
            ring[h, b, 1:] = ring[h, b, :-1]  # newest first
            ring[h, b, 0] = event.step - last[h, j]
            self.num_intervals[layer][h, b] = np.minimum(self.num_intervals[layer][h, b] + 1, NUM_INTERVALS)
        h, j = np.nonzero(selected)
        self.last_step[layer][h, idx[j]] = event.step
        self.count[layer][:, idx] += selected
        self.observed[layer][:, idx] += 1
        self.ema[layer][:, idx] = 0.7 * self.ema[layer][:, idx] + 0.3 * selected

    def features(self, event: ChoiceEvent) -> np.ndarray:
        """Feature rows [num_kv_heads, n, NUM_FEATURES] (float32) of the event's candidates, read after `update`."""
        idx = event.indices.astype(np.int64)
        layer, step = event.layer, event.step
        heads, n = self.num_kv_heads, idx.size
        out = np.empty((heads, n, NUM_FEATURES), dtype=np.float32)
        last = self.last_step[layer][:, idx]
        never = last < 0
        since = np.where(never, 64, step - last)
        out[..., 0] = np.log1p(since) / 5
        out[..., 1] = never
        out[..., 2] = last == step
        observed = self.observed[layer][:, idx]
        out[..., 3] = self.count[layer][:, idx] / np.maximum(observed, 1)
        out[..., 4] = self.ema[layer][:, idx]
        scores = event.scores.astype(np.float32)  # [heads, n]
        order = np.argsort(-scores, axis=1, kind="stable")
        rank = np.empty_like(order)
        np.put_along_axis(rank, order, np.arange(n)[None, :].repeat(heads, 0), axis=1)
        out[..., 5] = rank / max(n - 1, 1)
        budget = event.chosen.shape[1]
        kth = np.take_along_axis(scores, order[:, min(budget, n) - 1 : min(budget, n)], axis=1)  # [heads, 1]
        std = scores.std(axis=1, keepdims=True) + 1e-6
        out[..., 6] = np.clip((scores - kth) / std, -5, 5)
        out[..., 7] = idx / max(event.num_blocks, 1)
        out[..., 8] = 1.0 if event.level == 2 else 0.0
        ring = self.intervals[layer][:, idx]  # [heads, n, NUM_INTERVALS]
        k = self.num_intervals[layer][:, idx]  # [heads, n]
        valid = np.arange(NUM_INTERVALS)[None, None, :] < k[..., None]
        denom = np.maximum(k, 1)
        mean = (ring * valid).sum(-1) / denom
        var = (((ring - mean[..., None]) ** 2) * valid).sum(-1) / denom
        out[..., 9] = np.log1p(mean) / 5
        out[..., 10] = np.log1p(var) / 10
        out[..., 11] = k / NUM_INTERVALS
        out[..., 12] = np.clip(event.query_mean.astype(np.float32)[:, None] * 10, -5, 5)
        out[..., 13] = budget / max(n, 1)
        return out


def make_event(seq_id: int, step: int, layer: int, level: int, indices: list[int], scores: torch.Tensor,
               chosen: torch.Tensor, q: torch.Tensor, num_blocks: int) -> ChoiceEvent:
    """A ChoiceEvent from the cache's tensors: scores [heads, n], chosen [heads, budget], q [num_heads, head_dim]."""
    heads = scores.shape[0]
    qmean = q.float().reshape(heads, -1).mean(dim=1)
    return ChoiceEvent(seq_id, step, layer, level, np.asarray(indices, dtype=np.int32),
                       scores.detach().float().cpu().numpy().astype(np.float16),
                       chosen.detach().cpu().numpy().astype(np.int32), qmean.cpu().numpy(), num_blocks)


def trace_dataset(trace: TraceRecorder, horizon_steps: int = 1, levels: tuple[int, ...] = (2,),
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Replay a trace into (features [rows, F], labels [rows], group [rows]).

    A row is one candidate block of one (step, layer, KV head) choice on one of `levels`; its label is 1 when the
    block is chosen (on any level) by the same layer and head at one of the next `horizon_steps` steps. `group`
    numbers the (seq, step, layer, head) choices so precision/recall can be computed per choice. Choices whose
    future is not in the trace are dropped.
    """
    if not trace.events:
        raise ConfigError("the access trace is empty: record it with decode steps over L1/L2 blocks")
    heads = trace.events[0].scores.shape[0]
    num_layers = 1 + max(e.layer for e in trace.events)
    chosen_at: dict[tuple[int, int, int], list[set[int]]] = {}  # (seq, step, layer) -> per head logical ids
    last_step: dict[int, int] = {}
    for e in trace.events:
        per_head = chosen_at.setdefault((e.seq_id, e.step, e.layer), [set() for _ in range(heads)])
        for h in range(heads):
            per_head[h].update(e.indices[e.chosen[h]].tolist())
        last_step[e.seq_id] = max(last_step.get(e.seq_id, e.step), e.step)
    stats: dict[int, AccessStats] = {}
    feats, labels, groups = [], [], []
    group = 0
    for e in trace.events:
        st = stats.setdefault(e.seq_id, AccessStats(num_layers, heads))
        st.update(e)
        if e.level not in levels or e.step + horizon_steps > last_step[e.seq_id]:
            continue
        f = st.features(e)
        future = [chosen_at.get((e.seq_id, e.step + d, e.layer)) for d in range(1, horizon_steps + 1)]
        for h in range(heads):
            wanted = set().union(*(fut[h] for fut in future if fut is not None))
            feats.append(f[h])
            labels.append(np.fromiter((i in wanted for i in e.indices.tolist()), dtype=np.float32,
                                      count=e.indices.size))
            groups.append(np.full(e.indices.size, group, dtype=np.int64))
            group += 1
    if not feats:
        raise ConfigError(f"the trace has no choices on levels {levels} with {horizon_steps} later step(s) recorded")
    return np.concatenate(feats), np.concatenate(labels), np.concatenate(groups)


def lru_scores(features: np.ndarray) -> np.ndarray:
    """The recency/LRU baseline's ranking score from the same feature rows: most recently selected first, then the
    most often selected (no digest score, no interval statistics)."""
    return -features[:, FEATURE_NAMES.index("recency_log")] + 1e-3 * features[:, FEATURE_NAMES.index("frequency")]
