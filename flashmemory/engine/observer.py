"""StepObserver: what the engine core reports as it runs (the server's metrics and stats line listen)."""

from __future__ import annotations

from typing import Protocol


class StepObserver(Protocol):
    """Told of prefill work, sampled tokens, finished sequences and preemptions."""

    def on_prefill_tokens(self, n: int) -> None: ...

    def on_token(self, since_s: float, first: bool) -> None:
        """A token was sampled `since_s` seconds after the request arrived (first) or after its previous token."""

    def on_finished(self, reason: str, e2e_s: float | None) -> None:
        """A sequence ended: "stop", "length", "abort", "error" or "content_filter" (e2e_s:
        arrival to now, for stop/length)."""

    def on_preempted(self, kind: str, n: int) -> None:
        """`n` sequences were preempted: kind "demote" or "recompute"."""

    def on_fault(self, action: str) -> None:
        """A sequence hit a failure while being served: action "recompute" (retried) or "fail" (ended)."""

    def on_guardrail(self, result: str, latency_s: float) -> None:
        """A guardrail check was decided: "pass", "flagged", "timeout" or "error"."""


class NullObserver:
    """Observes nothing (the Python API)."""

    def on_prefill_tokens(self, n: int) -> None:
        pass

    def on_token(self, since_s: float, first: bool) -> None:
        pass

    def on_finished(self, reason: str, e2e_s: float | None) -> None:
        pass

    def on_preempted(self, kind: str, n: int) -> None:
        pass

    def on_fault(self, action: str) -> None:
        pass

    def on_guardrail(self, result: str, latency_s: float) -> None:
        pass
