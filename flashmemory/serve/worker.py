"""EngineWorker: the one thread that does torch work — it loads the engine, then drives its EngineCore (one batched
step at a time) and pushes each sequence's outputs to the event loop.

The asyncio side talks to it only through a thread-safe inbox (add, abort, stop) and the sinks it registered:
outputs travel back through `loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from flashmemory.engine.core import Delivery, EngineCore
from flashmemory.engine.request import SequenceRequest, Sink
from flashmemory.engine.scheduler import Scheduler
from flashmemory.errors import FlashMemoryError
from flashmemory.kvcache.kv_stats import BudgetStats
from flashmemory.serve.metrics import ServerMetrics
from flashmemory.serve.stats_log import StatsLogger

logger = logging.getLogger(__name__)

_IDLE_WAKEUP_S = 1.0  # how often an idle engine thread wakes to run the stats logger


class _MetricsObserver:
    """Feeds the core's reports to the server's Prometheus metrics and its periodic stats line."""

    def __init__(self, metrics: ServerMetrics, stats: StatsLogger) -> None:
        self.metrics = metrics
        self.stats = stats

    def on_prefill_tokens(self, n: int) -> None:
        self.metrics.prompt_tokens.inc(n)
        self.stats.record(prompt_tokens=n)

    def on_token(self, since_s: float, first: bool) -> None:
        (self.metrics.time_to_first_token if first else self.metrics.inter_token_latency).observe(since_s)
        self.metrics.generation_tokens.inc()
        self.stats.record(generation_tokens=1)

    def on_finished(self, reason: str, e2e_s: float | None) -> None:
        if e2e_s is not None:
            self.metrics.e2e_request_latency.observe(e2e_s)
        self.metrics.count_finished(reason)

    def on_preempted(self, kind: str, n: int) -> None:
        self.metrics.count_preemption(kind, n)
        self.stats.record(preemptions=n)

    def on_fault(self, action: str) -> None:
        self.metrics.count_fault(action)

    def on_guardrail(self, result: str, latency_s: float) -> None:
        self.metrics.count_guardrail(result, latency_s)


@dataclass
class PreloadJob:
    """A prompt's (or a saved session's) cached KV to bring up while the engine is idle."""

    token_ids: list[int] | None
    session: str | None
    deadline_s: float  # time.perf_counter() after which it stops
    future: Future  # set to the PreloadResult (or the error) on the engine thread


class EngineWorker:
    """Owns the engine thread, the engine and its core; the inbox and the outputs waiting to be sent."""

    def __init__(self, engine_factory: Callable[[], Any], metrics: ServerMetrics, max_num_batched_tokens: int | None,
                 stats_log_interval_s: float, on_load_failure: Callable[[str], None] | None = None,
                 on_fatal: Callable[[str], None] | None = None) -> None:
        self._engine_factory = engine_factory
        self.metrics = metrics
        self._max_num_batched_tokens = max_num_batched_tokens  # None = the engine's prefill_chunk_tokens
        self._stats = StatsLogger(stats_log_interval_s)
        self._idle_wakeup_s = min(_IDLE_WAKEUP_S, stats_log_interval_s) if stats_log_interval_s > 0 else _IDLE_WAKEUP_S
        self._on_load_failure = on_load_failure
        self._on_fatal = on_fatal  # the engine died at run time (the device is lost): the server should exit
        self._inbox: queue.Queue[tuple] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="flashmemory-engine", daemon=True)
        self._seq_ids = itertools.count()
        self.ready = threading.Event()
        self.state = "loading"  # "loading" -> "ready" -> "stopped", or "dead" (load failure or crash)
        self.error: str | None = None
        self.engine: Any = None
        self.core: EngineCore | None = None
        self.kv_stats: dict[str, int | float] = {}  # latest snapshot, replaced whole after every step
        self.health: dict[str, Any] = {"status": "ok"}  # the engine's (GET /health), as kv_stats
        self._outbox: list[Delivery] = []  # sent after each step's bookkeeping is published
        self._preloads: list[PreloadJob] = []  # run while no sequence needs the engine

    @property
    def scheduler(self) -> Scheduler | None:
        return self.core.scheduler if self.core is not None else None

    # ---- called from any thread -------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, requests: list[SequenceRequest], sink: Sink) -> list[int]:
        """Queue sequences for generation; returns their ids (for abort)."""
        seq_ids = [next(self._seq_ids) for _ in requests]
        self._inbox.put(("add", list(zip(seq_ids, requests)), sink))
        return seq_ids

    def preload(self, token_ids: list[int] | None, session: str | None, timeout_s: float) -> Future:
        """Queue a preload (kvcache/preload.py); it runs when no sequence needs the engine and
        stops at the next request or after `timeout_s`. The future gets its PreloadResult."""
        job = PreloadJob(token_ids, session, time.perf_counter() + timeout_s, Future())
        self._inbox.put(("preload", job))
        return job.future

    def abort(self, seq_ids: list[int]) -> None:
        """Stop the sequences and free their KV on every level (no more outputs are sent for them)."""
        self._inbox.put(("abort", list(seq_ids)))

    def stop(self, timeout_s: float = 30.0) -> None:
        if self._thread.is_alive():
            self._inbox.put(("stop",))
            self._thread.join(timeout_s)

    # ---- the engine thread ------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.engine = self._engine_factory()
            self.core = self.engine.configure_core(self._max_num_batched_tokens,
                                                   _MetricsObserver(self.metrics, self._stats))
        except Exception as e:  # noqa: BLE001 - any load failure is reported, not raised in a thread
            # Typed errors carry a message meant for users; anything else stays in the log (GET /health is public).
            typed = isinstance(e, FlashMemoryError)
            self.error = str(e) if typed else f"{type(e).__name__} (the server log has the details)"
            self.state = "dead"
            logger.error("the engine failed to load: %s", e, exc_info=not typed)
            self.ready.set()
            if self._on_load_failure is not None:
                self._on_load_failure(self.error)
            return
        chunk = self.engine.config.prefill_chunk_tokens
        if self.core.scheduler.max_num_batched_tokens > chunk:
            logger.warning("max_num_batched_tokens=%d is above prefill_chunk_tokens=%d: the activation workspace "
                           "sized at start-up covers only %d tokens per forward",
                           self.core.scheduler.max_num_batched_tokens, chunk, chunk)
        self.state = "ready"
        self._publish()
        self.ready.set()
        try:
            self._loop()
            self.state = "stopped"
        except Exception as e:  # noqa: BLE001 - the engine died: every request hears about it, /health says so
            logger.exception("the engine thread died")
            self.error = f"the engine stopped: {type(e).__name__}"
            self.state = "dead"
            self._outbox.extend(self.core.fail_all("the engine stopped unexpectedly; the server log has the details"))
            if self._on_fatal is not None:  # before the clients hear: whoever reads the error finds the server stopping
                self._on_fatal(self.error)
            self._send_outputs()
        finally:
            self.engine.close()

    def _loop(self) -> None:
        assert self.core is not None
        while True:
            if not self._drain_inbox(block=not self.core.has_work() and not self._preloads):
                for job in self._preloads:  # stopping: nobody will run them
                    job.future.set_exception(RuntimeError("the server is stopping"))
                return
            if self._preloads and not self.core.has_work():
                with torch.inference_mode():
                    self._run_preload(self._preloads.pop(0))
            elif self.core.has_work():
                with torch.inference_mode():
                    self._outbox.extend(self.engine.step_core(self.core))
            else:
                if self.engine.budget_controller is not None:
                    # idle time counts too (and lowers the L0 budget)
                    self.engine.budget_controller.tick()
                self._compact_when_idle()
            self._publish()
            # NOTE: outputs go out after the gauges and the KV snapshot are updated, so a client that has its
            # final chunk never sees its own request still counted as running or holding blocks.
            self._send_outputs()

    def _send_outputs(self) -> None:
        outbox, self._outbox = self._outbox, []
        for sink, out in outbox:
            sink(out)

    def _drain_inbox(self, block: bool) -> bool:
        """Apply queued adds and aborts; False when asked to stop."""
        try:
            message = self._inbox.get(timeout=self._idle_wakeup_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if message[0] == "stop":
                return False
            if message[0] == "add":
                for seq_id, request in message[1]:
                    self.core.add(request, message[2], seq_id)
            elif message[0] == "abort":
                for seq_id in message[1]:
                    self.core.abort(seq_id)
            elif message[0] == "preload":
                self._preloads.append(message[1])
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _compact_when_idle(self) -> None:
        """Idle (no sequence, no preload): give back the disk of freed cold records, stopping
        before the next run of them as soon as anything arrives in the inbox."""
        if any(v for k, v in self.kv_stats.items() if k.endswith("_bytes_reclaimable")):
            self.engine.compact_kv(lambda: not self._inbox.empty())

    def _run_preload(self, job: PreloadJob) -> None:
        """One preload on the engine thread, stopped by anything arriving in the inbox (a request
        is served first) or its deadline."""
        left_s = max(0.0, job.deadline_s - time.perf_counter())

        def arrived() -> bool:
            return not self._inbox.empty()

        try:
            if job.session is None:
                result = self.engine.preload(job.token_ids, left_s, arrived)
            else:
                result = self.engine.preload_session(job.session, left_s, arrived)
            job.future.set_result(result)
        except Exception as e:  # noqa: BLE001 - the caller hears it; the engine goes on
            job.future.set_exception(e)

    def _publish(self) -> None:
        """Refresh the gauges and the KV snapshot; maybe write the periodic stats line."""
        s = self.core.scheduler
        stats = self.engine.cache.kv_stats()
        if self.engine.budget_controller is not None:
            stats.budget = BudgetStats(**self.engine.budget_controller.stats())
        self.kv_stats = stats.as_dict()
        self.health = self.engine.health()  # probes the levels here, on the thread that owns them
        spec = self.engine.speculator
        self.metrics.publish_kv(stats, None if spec is None else spec.stats)
        self.metrics.num_requests_running.set(s.num_running)
        self.metrics.num_requests_waiting.set(s.num_waiting)
        self.metrics.num_requests_parked.set(len(s.parked))
        self._stats.maybe_log(s.num_running, s.num_waiting, stats)
