"""GuardrailPool: checks run on the pool's own CPU threads (torch with one intra-op thread each,
so they never wait on the engine's thread team), each with a deadline. A check not answered by its
deadline is skipped: counted once as a timeout, logged, cancelled if it has not started, and never
retried (the seed's post-mortem: retries made latency avalanche)."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field

import torch

from flashmemory.guardrail.classifier import RESULTS, Guardrail, Verdict, judge

logger = logging.getLogger(__name__)
_LOG_EVERY_S = 10.0  # timeouts and errors are logged at most this often (each is counted)


@dataclass
class GuardrailStats:
    """Checks decided since the engine started, by result, and their latency."""

    checks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RESULTS, 0))
    latency_s_total: float = 0.0  # of the answered checks (pass, flagged, error)

    def as_dict(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {f"guardrail_{k}": v for k, v in self.checks.items()}
        answered = sum(self.checks.values()) - self.checks["timeout"]
        mean_s = self.latency_s_total / answered if answered else 0.0
        out["guardrail_mean_latency_ms"] = 1e3 * mean_s
        return out


class Check:
    """One submitted check; its verdict is decided once, by `GuardrailPool.poll`."""

    def __init__(self, future: Future, submitted_s: float, timeout_s: float) -> None:
        self.future = future
        self.submitted_s = submitted_s
        self.deadline_s = submitted_s + timeout_s
        self.verdict: Verdict | None = None


class GuardrailPool:
    """The classifier, its threads and its counters."""

    def __init__(self, classifier: Guardrail, threshold: float, timeout_ms: float,
                 threads: int = 1) -> None:
        self.classifier = classifier
        self.threshold = threshold
        self.timeout_s = timeout_ms / 1e3
        self.stats = GuardrailStats()
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="guardrail",
                                            initializer=torch.set_num_threads, initargs=(1,))
        self._logged_s = -_LOG_EVERY_S

    def submit(self, text: str) -> Check:
        submitted = time.perf_counter()
        return Check(self._executor.submit(self._run, text, submitted), submitted, self.timeout_s)

    def _run(self, text: str, submitted_s: float) -> Verdict:
        try:
            scores = self.classifier.scores(text)
        except Exception as e:  # noqa: BLE001 - a classifier's failure is a verdict, not a crash
            return Verdict("error", time.perf_counter() - submitted_s,
                           error=f"{type(e).__name__}: {e}")
        return judge(scores, self.threshold, time.perf_counter() - submitted_s)

    def poll(self, check: Check, now_s: float | None = None) -> Verdict | None:
        """The check's verdict once decided (None before): its answer, or a timeout when it was
        not answered by its deadline (an answer that came later than the deadline is one too)."""
        if check.verdict is not None:
            return check.verdict
        now_s = time.perf_counter() if now_s is None else now_s
        verdict: Verdict | None = None
        if check.future.done():
            verdict = check.future.result()
            if verdict.latency_s > self.timeout_s:
                verdict = Verdict("timeout", verdict.latency_s)
        elif now_s >= check.deadline_s:
            check.future.cancel()  # not started yet: it never runs; running: its answer is ignored
            verdict = Verdict("timeout", now_s - check.submitted_s)
        if verdict is not None:
            self._count(verdict)
            check.verdict = verdict
        return verdict

    def wait(self, checks: list[Check], timeout_s: float) -> None:
        """Block until one of `checks` is answered or `timeout_s` passes (at most to the earliest
        deadline)."""
        if not checks:
            return
        earliest = min(c.deadline_s for c in checks) - time.perf_counter()
        wait_futures([c.future for c in checks], max(0.0, min(timeout_s, earliest)),
                     return_when="FIRST_COMPLETED")

    def _count(self, verdict: Verdict) -> None:
        self.stats.checks[verdict.result] += 1
        if verdict.result != "timeout":
            self.stats.latency_s_total += verdict.latency_s
        now = time.monotonic()
        if verdict.result in ("timeout", "error") and now - self._logged_s >= _LOG_EVERY_S:
            self._logged_s = now
            logger.warning("guardrail %s (%s): %s; skipped, not retried (%d timeouts, %d "
                           "errors so far)",
                           verdict.result, self.classifier.name,
                           verdict.error or f"no answer within {1e3 * self.timeout_s:.0f} ms",
                           self.stats.checks["timeout"], self.stats.checks["error"])

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
