"""Where a trial's needle was when the answer was decoded: on which level, how its block ranked
under the
selection digest, and how often it was chosen (a ChoiceObserver on the tiered cache)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from flashmemory.kvcache.read.choice import LayerChoice

LEVEL_NAMES = {1: "L1", 2: "L2"}
IN_WINDOW = (
    "L0"  # never a candidate: the needle's blocks were read whole (the window, the sink, the rows)
)


@dataclass
class NeedleSight:
    """Over one trial's decode steps, every (step, layer, KV head, needle block) seen as a
    candidate."""

    levels: dict[str, int] = field(default_factory=dict)  # level -> candidate sightings there
    chosen: int = 0
    ranks: list[int] = field(default_factory=list)  # 0 = the best-scored candidate

    def summary(self) -> dict[str, Any]:
        seen = sum(self.levels.values())
        if not seen:
            return {"level": IN_WINDOW, "chosen_share": 1.0, "median_rank": None, "candidates": 0}
        ranks = sorted(self.ranks)
        return {
            "level": max(self.levels, key=self.levels.get),
            "chosen_share": self.chosen / seen,
            "median_rank": ranks[len(ranks) // 2],
            "candidates": seen,
        }


class NeedleProbe:
    """Watches the choices made while one trial decodes; `start(blocks)` names the needle's block
    indices."""

    def __init__(self) -> None:
        self.blocks = torch.empty(0, dtype=torch.int64)
        self.sight = NeedleSight()

    def start(self, spans: list[tuple[int, int]], block_size: int) -> None:
        """The blocks of the trial's first target needle (the one at its depth)."""
        start, end = spans[0]
        self.blocks = torch.arange(
            start // block_size, (end - 1) // block_size + 1, dtype=torch.int64
        )
        self.sight = NeedleSight()

    def on_choose(self, choice: LayerChoice) -> None:
        indices = choice.indices.to("cpu")
        where = torch.nonzero(torch.isin(indices, self.blocks)).flatten()
        if where.numel() == 0:
            return
        level = LEVEL_NAMES.get(choice.level, f"L{choice.level}")
        scores = choice.scores.float().cpu()  # [heads, n]
        chosen = choice.chosen.cpu()  # [heads, budget] positions into indices
        for pos in where.tolist():
            for head in range(scores.shape[0]):
                self.sight.levels[level] = self.sight.levels.get(level, 0) + 1
                self.sight.ranks.append(int((scores[head] > scores[head, pos]).sum()))
                self.sight.chosen += int((chosen[head] == pos).any())

    def on_step_end(self, seq_id: int) -> None:
        pass

    def on_step_abort(self, seq_id: int) -> None:
        pass
