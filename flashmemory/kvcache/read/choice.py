"""LayerChoice and ChoiceObserver: what a decode step's query-aware choice tells whoever watches it (the trace
recorder, the prefetcher), without the read path knowing who they are."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class LayerChoice:
    """One query-aware choice as the cache makes it: one decode step, layer and level, every KV head."""

    seq_id: int
    step: int  # the sequence's position (tokens before the decoded one)
    layer: int
    level: int  # 1 = L1 (host), 2 = L2 (disk)
    indices: torch.Tensor  # [n] int64 logical block indices of the candidates (the same object for every layer)
    scores: torch.Tensor  # [heads, n] float32 Quest upper-bound scores (on the compute device)
    chosen: torch.Tensor  # [heads, budget] int64 positions into `indices` (on the compute device)
    query_mean: torch.Tensor  # [heads] float32 mean of the query heads sharing each KV head (compute device)
    num_blocks: int  # full blocks of the sequence
    slots: torch.Tensor | None  # [n] int64 the candidates' slots on their level (None in a replayed trace)


class ChoiceObserver(Protocol):
    """Told of every query-aware choice a decode step makes, and of the step's end (all layers read)."""

    def on_choose(self, choice: LayerChoice) -> None: ...

    def on_step_end(self, seq_id: int) -> None: ...

    def on_step_abort(self, seq_id: int) -> None:
        """The step failed before it ended: forget its choices (it will run again)."""
