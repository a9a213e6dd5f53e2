"""What an output classifier is: text in, a score in [0, 1] per label out; and the verdict a
check reaches from those scores."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

# A check's result, and the label of flashmemory:guardrail_checks_total.
RESULTS = ("pass", "flagged", "timeout", "error")


class Guardrail(Protocol):
    """An output classifier. `scores` is called from the guardrail's own threads, one text at a
    time per thread; it must not touch the engine's device."""

    name: str
    labels: tuple[str, ...]

    def scores(self, text: str) -> dict[str, float]:
        """A score in [0, 1] for each label (sigmoid or softmax probabilities)."""
        ...

    def weights_bytes(self) -> int:
        """Bytes its weights hold in host memory (counted, not estimated)."""
        ...


@dataclass(frozen=True)
class Verdict:
    """What one check decided."""

    result: str  # one of RESULTS
    latency_s: float  # submitted to decided (a timeout's is the timeout)
    label: str | None = None  # flagged: the highest-scoring label at or over the threshold
    score: float | None = None
    error: str | None = None  # error: the classifier's exception, as text

    @property
    def releases(self) -> bool:
        """The checked text may go to the client (passed, or skipped by a timeout)."""
        return self.result in ("pass", "timeout")

    def describe(self) -> str:
        """What a client is told when the verdict ends its output."""
        if self.result == "flagged":
            return f"guardrail: {self.label} ({self.score:.2f})"
        return f"guardrail error: {self.error}"


def judge(scores: dict[str, float], threshold: float, latency_s: float) -> Verdict:
    """The verdict for one check's scores: flagged by its top label at or over `threshold`."""
    over = {k: v for k, v in scores.items() if v >= threshold}
    if not over:
        return Verdict("pass", latency_s)
    label = max(over, key=over.__getitem__)
    return Verdict("flagged", latency_s, label, float(over[label]))
