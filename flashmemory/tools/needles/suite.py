"""Which trials a needle run makes (SuiteSpec) and how they are laid out: each trial its own
haystack (tasks.py, RULER's layout) or every trial of a length in one (shared.py)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from flashmemory.errors import ConfigError
from flashmemory.tools.needles.shared import build_shared
from flashmemory.tools.needles.tasks import TASKS, NeedleTrial, TrialBuilder

# Each trial its own haystack (RULER's); or one per length and seed (needles/shared.py).
LAYOUTS = ("separate", "shared")


@dataclass(frozen=True)
class SuiteSpec:
    """Which trials a run makes: every task x length x depth, `trials_per_cell` seeds each."""

    tasks: Sequence[str] = TASKS
    lengths_tokens: Sequence[int] = (1024, 1536)
    depths: Sequence[float] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
    trials_per_cell: int = 1
    seed: int = 0
    layout: str = "separate"

    @property
    def num_trials(self) -> int:
        return len(self.tasks) * len(self.lengths_tokens) * len(self.depths) * self.trials_per_cell


def build_trials(builder: TrialBuilder, spec: SuiteSpec) -> Iterator[NeedleTrial]:
    for task in spec.tasks:
        if task not in TASKS:
            raise ConfigError(f"unknown needle task {task!r}; choose from {', '.join(TASKS)}")
    if spec.layout not in LAYOUTS:
        raise ConfigError(
            f"unknown needle layout {spec.layout!r}; choose from {', '.join(LAYOUTS)}"
        )
    if spec.layout == "shared":
        for length in spec.lengths_tokens:
            for i in range(spec.trials_per_cell):
                yield from build_shared(
                    builder, spec.tasks, length, spec.depths, spec.seed * 1000 + i
                )
        return
    for length in spec.lengths_tokens:
        for task in spec.tasks:
            # Deepest first: each trial then shares its haystack up to its own needle with the one
            # before.
            for depth in sorted(spec.depths, reverse=True):
                for i in range(spec.trials_per_cell):
                    yield builder.build(task, length, depth, spec.seed * 1000 + i)
