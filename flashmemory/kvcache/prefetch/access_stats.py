"""Per-block selection statistics of one sequence and the heat predictor's feature rows, for a whole decode step.

A decode step makes one query-aware choice per layer and level (every KV head at once). `StepChoices` stacks one
level's choices of every layer of one step (the candidates are the same blocks in every layer: the step's plan);
`AccessStats` folds a step into running per-(layer, KV head, logical block) statistics and turns them into feature
rows [layers, heads, candidates, NUM_FEATURES] — a fixed number of tensor operations per step whatever the number
of layers, so ranking costs well under a millisecond (see heat_predictor). The same code runs online (prefetch,
from the live cache's tensors) and offline (training, from a recorded trace), so the features a model is trained
on are the features it is served.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from flashmemory.kvcache import native
from flashmemory.kvcache.read.choice import LayerChoice

NUM_INTERVALS = 10  # access intervals kept per block for the interval statistics
NEVER_SELECTED_STEPS = 64  # "steps since last selected" of a block never selected
EMA_DECAY = 0.7  # per step, of the "selected" average
FEATURE_NAMES = (
    "recency_log",  # log1p(steps since last selected) / 5; never selected counts as NEVER_SELECTED_STEPS
    "never_selected",
    "selected_now",
    "frequency",  # times selected / times a candidate
    "ema",  # exponential average of "selected" (EMA_DECAY per step)
    "score_z",  # (score - mean of the candidates' scores) / their std
    "score_margin",  # (score - the lowest chosen score) / std of the scores
    "position",  # logical block index / number of blocks in the sequence
    "level",  # 0 = L1, 1 = L2
    "interval_mean_log",
    "interval_var_log",
    "num_intervals",  # intervals recorded / NUM_INTERVALS
    "query_mean",  # mean of the query heads of this KV head (scaled)
    "budget_fraction",  # blocks chosen / candidates
)
NUM_FEATURES = len(FEATURE_NAMES)
COLUMN = {name: i for i, name in enumerate(FEATURE_NAMES)}


@dataclass
class StepChoices:
    """One level's query-aware choices at one decode step of one sequence, stacked over layers."""

    step: int  # the sequence's position (tokens before the decoded one)
    level: int  # 1 = L1 (host), 2 = L2 (disk)
    layers: torch.Tensor  # [l] int64 layer numbers (usually every layer, in order)
    indices: torch.Tensor  # [n] int64 logical block indices of the candidates
    scores: torch.Tensor  # [l, heads, n] float32 Quest upper-bound scores
    chosen: torch.Tensor  # [l, heads, budget] int64 positions into `indices`
    query_mean: torch.Tensor  # [l, heads] float32 mean of the query heads sharing each KV head
    num_blocks: int  # full blocks of the sequence at this step (for the position feature)
    slots: torch.Tensor | None = None  # [n] int64 the candidates' slots on their level (None in a replayed trace)

    @property
    def budget(self) -> int:
        return self.chosen.shape[2]

    @classmethod
    def stack(cls, choices: list[LayerChoice]) -> "StepChoices":
        """One level's choices of one step (same candidates and budget in every layer), in layer order.

        Scores are rounded to float16, as traces store them, so the features served online are exactly those a
        model is trained on offline."""
        first = choices[0]
        return cls(first.step, first.level, torch.tensor([c.layer for c in choices], dtype=torch.int64),
                   first.indices.to(torch.int64).cpu(), torch.stack([c.scores for c in choices]).half().float().cpu(),
                   torch.stack([c.chosen for c in choices]).to(torch.int64).cpu(),
                   torch.stack([c.query_mean for c in choices]).float().cpu(), first.num_blocks,
                   None if first.slots is None else first.slots.to(torch.int64).cpu())


class AccessStats:
    """Owns running selection statistics per (layer, KV head, logical block) of one sequence; emits feature rows.

    State tensors are [layers, heads, capacity_blocks]. A step's candidates are nearly always one run of logical
    blocks in every layer, so the statistics are read and updated through slice views (no gathers); the interval
    ring is updated only where a block was selected again, with its sums kept alongside (exact int64), so the
    interval features cost O(cells), not O(cells x NUM_INTERVALS). That usual case runs in the native kernel
    (csrc/access_stats.c, the same arithmetic) when it is built; this torch code is the reference and serves the
    rest.
    """

    def __init__(self, num_layers: int, num_kv_heads: int) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.capacity = 0
        self._lib = native.library()
        self._grow(256)

    def _grow(self, capacity: int) -> None:
        def grown(old: torch.Tensor | None, fill: float, dtype: torch.dtype, extra: tuple[int, ...] = ()):
            new = torch.full((self.num_layers, self.num_kv_heads, capacity, *extra), fill, dtype=dtype)
            if old is not None:
                new[:, :, : old.shape[2]] = old
            return new

        first = self.capacity == 0
        self.last_step = grown(None if first else self.last_step, -1, torch.int64)
        self.count = grown(None if first else self.count, 0, torch.float32)
        self.observed = grown(None if first else self.observed, 0, torch.float32)
        self.ema = grown(None if first else self.ema, 0, torch.float32)
        self.ring = grown(None if first else self.ring, 0, torch.int64, (NUM_INTERVALS,))  # last intervals
        self.ring_head = grown(None if first else self.ring_head, 0, torch.int64)  # next position to write
        self.num_intervals = grown(None if first else self.num_intervals, 0, torch.int64)
        self.interval_sum = grown(None if first else self.interval_sum, 0, torch.int64)
        self.interval_sumsq = grown(None if first else self.interval_sumsq, 0, torch.int64)
        self.capacity = capacity

    def _cells(self, c: StepChoices):
        """The step's (layer, head, candidate) cells of the state tensors: a slice (a view) when the candidates
        are one run of blocks in every layer, else an advanced index (a copy; written back with index_put)."""
        n = c.indices.numel()
        first = int(c.indices[0])
        if (c.layers.numel() == self.num_layers and int(c.layers[0]) == 0 and int(c.layers[-1]) == self.num_layers - 1
                and int(c.indices[-1]) - first == n - 1):
            return slice(None), slice(None), slice(first, first + n)
        heads = torch.arange(self.num_kv_heads)
        return c.layers[:, None, None], heads[None, :, None], c.indices[None, None, :]

    def update(self, c: StepChoices) -> None:
        """Fold one step's choices into the statistics of its candidates.

        Dense work (every candidate) is two in-place operations on views; everything else touches only the
        chosen cells, found straight from `chosen` (flat indices into the [layers, heads, capacity] state)."""
        if c.indices.numel() == 0:
            return
        top = int(c.indices.max())
        if top >= self.capacity:
            self._grow(max(2 * self.capacity, top + 1))
        at = self._cells(c)
        if self._lib is not None and isinstance(at[2], slice) and self._native_update(c, at[2].start):
            return
        heads = torch.arange(self.num_kv_heads)[None, :, None]
        cells = ((c.layers[:, None, None] * self.num_kv_heads + heads) * self.capacity + c.indices[c.chosen]).reshape(-1)
        last = self.last_step.view(-1).index_select(0, cells)
        again = last >= 0
        if bool(again.any()):  # selected before and now: a new access interval
            cell = cells[again]
            interval = c.step - last[again]
            k = self.num_intervals.view(-1).index_select(0, cell)
            head = self.ring_head.view(-1).index_select(0, cell)
            slot = cell * NUM_INTERVALS + head
            dropped = torch.where(k == NUM_INTERVALS, self.ring.view(-1).index_select(0, slot), 0)
            self.ring.view(-1).index_copy_(0, slot, interval)
            self.ring_head.view(-1).index_copy_(0, cell, (head + 1) % NUM_INTERVALS)
            self.num_intervals.view(-1).index_copy_(0, cell, (k + 1).clamp(max=NUM_INTERVALS))
            self.interval_sum.view(-1).index_add_(0, cell, interval - dropped)
            self.interval_sumsq.view(-1).index_add_(0, cell, interval * interval - dropped * dropped)
        self.last_step.view(-1).index_fill_(0, cells, c.step)
        ones = torch.ones(cells.numel(), dtype=torch.float32)
        self.count.view(-1).index_add_(0, cells, ones)
        if isinstance(at[2], slice):
            self.observed[at].add_(1)
            self.ema[at].mul_(EMA_DECAY)
        else:
            self.observed[at] = self.observed[at] + 1
            self.ema[at] = EMA_DECAY * self.ema[at]
        self.ema.view(-1).index_add_(0, cells, ones, alpha=1 - EMA_DECAY)

    def features(self, c: StepChoices) -> torch.Tensor:
        """Feature-major rows [NUM_FEATURES, l, heads, n] (float32) of the step's candidates, read after `update`
        (feature-major: each feature is one contiguous write, and the predictor's kernel reads it so)."""
        at = self._cells(c)
        n = c.indices.numel()
        out = torch.empty((NUM_FEATURES, *c.scores.shape), dtype=torch.float32)
        if self._lib is not None and isinstance(at[2], slice) and self._native_features(c, at[2].start, out):
            return out
        last = self.last_step[at]
        never = last < 0
        since = (c.step - last).masked_fill_(never, NEVER_SELECTED_STEPS)
        torch.log1p(since.float(), out=out[0]).div_(5)
        out[1].copy_(never)
        out[2].copy_(last == c.step)
        torch.div(self.count[at], self.observed[at].clamp(min=1), out=out[3])
        out[4].copy_(self.ema[at])
        scores = c.scores.float()
        mean = scores.mean(dim=-1, keepdim=True)
        std = ((scores * scores).mean(dim=-1, keepdim=True) - mean * mean).clamp_(min=0).sqrt_().add_(1e-6)
        kth = scores.gather(-1, c.chosen).amin(dim=-1, keepdim=True)  # the lowest chosen: the budget line
        torch.sub(scores, mean, out=out[5]).div_(std).clamp_(-5, 5)
        torch.sub(scores, kth, out=out[6]).div_(std).clamp_(-5, 5)
        out[7].copy_((c.indices.float() / max(c.num_blocks, 1)).expand_as(out[7]))
        out[8].fill_(1.0 if c.level == 2 else 0.0)
        k = self.num_intervals[at]
        denom = k.clamp(min=1).double()  # from the exact int64 sums, in double: E[x^2] - E[x]^2 cancels
        mean_interval = self.interval_sum[at].double() / denom
        var = (self.interval_sumsq[at].double() / denom - mean_interval * mean_interval).clamp_(min=0)
        torch.log1p(mean_interval.float(), out=out[9]).div_(5)
        torch.log1p(var.float(), out=out[10]).div_(10)
        torch.div(k.float(), NUM_INTERVALS, out=out[11])
        out[12].copy_((c.query_mean.float().unsqueeze(-1) * 10).clamp(-5, 5).expand_as(out[12]))
        out[13].fill_(c.budget / max(n, 1))
        return out

    # ---- the native kernel (the usual case: every layer, one run of blocks) ------------------------------------

    def _state(self) -> list[ctypes.c_void_p]:
        return [ctypes.c_void_p(t.data_ptr()) for t in (self.last_step, self.count, self.observed, self.ema)]

    def _native_update(self, c: StepChoices, first: int) -> bool:
        chosen = c.chosen.to(torch.int64).contiguous()
        rc = self._lib.fm_access_update(
            self.num_layers, self.num_kv_heads, self.capacity, first, c.indices.numel(), c.step,
            ctypes.c_void_p(chosen.data_ptr()), chosen.shape[2], *self._state(),
            *(ctypes.c_void_p(t.data_ptr()) for t in (self.ring, self.ring_head, self.num_intervals,
                                                      self.interval_sum, self.interval_sumsq)))
        return rc == 0

    def _native_features(self, c: StepChoices, first: int, out: torch.Tensor) -> bool:
        chosen = c.chosen.to(torch.int64).contiguous()
        scores = c.scores.to(torch.float32).contiguous()
        query_mean = c.query_mean.to(torch.float32).contiguous()
        rc = self._lib.fm_access_features(
            self.num_layers, self.num_kv_heads, self.capacity, first, c.indices.numel(), c.step,
            ctypes.c_void_p(chosen.data_ptr()), chosen.shape[2], ctypes.c_void_p(scores.data_ptr()),
            ctypes.c_void_p(query_mean.data_ptr()), c.num_blocks, c.level, *self._state(),
            *(ctypes.c_void_p(t.data_ptr()) for t in (self.num_intervals, self.interval_sum,
                                                      self.interval_sumsq)),
            ctypes.c_void_p(out.data_ptr()))
        return rc == 0
