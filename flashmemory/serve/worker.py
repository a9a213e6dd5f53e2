"""EngineWorker: the one thread that does torch work — it loads the engine, then runs scheduler steps (one batched
forward over every scheduled sequence), samples, detokenizes, and pushes each sequence's new text to the event loop.

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
from dataclasses import dataclass
from typing import Any

import torch

from flashmemory.engine.sampling import Sampler, SamplingParams
from flashmemory.engine.stop import StopStringMatcher
from flashmemory.errors import CapacityError, FlashMemoryError
from flashmemory.kvcache.interface import ForwardBatch
from flashmemory.kvcache.tiered import TieredKVCache
from flashmemory.model.tokenizer import IncrementalDetokenizer
from flashmemory.kvcache.manager.capacity import KVBudget
from flashmemory.serve.metrics import ServerMetrics
from flashmemory.engine.scheduler import Scheduler, Sequence, SequenceStatus, StepPlan
from flashmemory.serve.stats_log import StatsLogger

logger = logging.getLogger(__name__)

_IDLE_WAKEUP_S = 1.0  # how often an idle engine thread wakes to run the stats logger


@dataclass
class SequenceOutput:
    """What one step produced for one sequence (one choice of a request)."""

    index: int  # the choice index within its request
    text: str  # newly released text (may be empty)
    num_new_tokens: int
    finish_reason: str | None = None  # "stop" | "length" when the sequence is done
    error: str | None = None  # the sequence failed; the message is safe to show a client


@dataclass
class SequenceRequest:
    """One choice to generate, as the frontend submits it (already tokenized and validated)."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams
    arrival_s: float  # time.perf_counter() when the HTTP request arrived


Sink = Callable[[SequenceOutput], None]


@dataclass
class _Live:
    """Engine-thread state of one sequence besides what the scheduler tracks."""

    seq: Sequence
    index: int
    sampler: Sampler
    detok: IncrementalDetokenizer
    stopper: StopStringMatcher
    params: SamplingParams
    sink: Sink
    arrival_s: float
    last_token_s: float | None = None


class EngineWorker:
    """Owns the engine thread, the engine, the scheduler and every live sequence."""

    def __init__(self, engine_factory: Callable[[], Any], metrics: ServerMetrics, max_num_batched_tokens: int | None,
                 stats_log_interval_s: float, on_load_failure: Callable[[str], None] | None = None) -> None:
        self._engine_factory = engine_factory
        self.metrics = metrics
        self._max_num_batched_tokens = max_num_batched_tokens  # None = the engine's prefill_chunk_tokens
        self._stats = StatsLogger(stats_log_interval_s)
        self._idle_wakeup_s = min(_IDLE_WAKEUP_S, stats_log_interval_s) if stats_log_interval_s > 0 else _IDLE_WAKEUP_S
        self._on_load_failure = on_load_failure
        self._inbox: queue.Queue[tuple] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="flashmemory-engine", daemon=True)
        self._seq_ids = itertools.count()
        self.ready = threading.Event()
        self.state = "loading"  # "loading" -> "ready" -> "stopped", or "dead" (load failure or crash)
        self.error: str | None = None
        self.engine: Any = None
        self.scheduler: Scheduler | None = None
        self.kv_stats: dict[str, int | float] = {}  # latest snapshot, replaced whole after every step
        self._live: dict[int, _Live] = {}
        self._outbox: list[tuple[Sink, SequenceOutput]] = []  # sent after each step's bookkeeping is published

    # ---- called from any thread -------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, requests: list[SequenceRequest], sink: Sink) -> list[int]:
        """Queue sequences for generation; returns their ids (for abort)."""
        seq_ids = [next(self._seq_ids) for _ in requests]
        self._inbox.put(("add", list(zip(seq_ids, requests)), sink))
        return seq_ids

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
            self.scheduler = Scheduler(kv_budget(self.engine),
                                       self._max_num_batched_tokens or self.engine.config.prefill_chunk_tokens)
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
        if self.scheduler.max_num_batched_tokens > chunk:
            logger.warning("max_num_batched_tokens=%d is above prefill_chunk_tokens=%d: the activation workspace "
                           "sized at start-up covers only %d tokens per forward", self.scheduler.max_num_batched_tokens,
                           chunk, chunk)
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
            for live in list(self._live.values()):
                try:
                    self._fail(live, "the engine stopped unexpectedly; the server log has the details")
                except Exception:  # noqa: BLE001 - the cache may be what broke; the clients must still hear
                    self._outbox.append((live.sink, SequenceOutput(live.index, "", 0, None, error="the engine "
                                                                   "stopped unexpectedly")))
            self._send_outputs()
        finally:
            self.engine.close()

    def _loop(self) -> None:
        assert self.scheduler is not None
        while True:
            if not self._drain_inbox(block=not self.scheduler.has_work()):
                return
            if self.scheduler.has_work():
                with torch.inference_mode():
                    self._step()
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
                    self._add(seq_id, request, message[2])
            elif message[0] == "abort":
                for seq_id in message[1]:
                    self._abort(seq_id)
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _add(self, seq_id: int, request: SequenceRequest, sink: Sink) -> None:
        engine = self.engine
        seq = Sequence(seq_id, list(request.prompt_ids), request.params.max_new_tokens)
        self._live[seq_id] = _Live(
            seq, request.index, Sampler(request.params, engine.device),
            IncrementalDetokenizer(engine.tokenizer, request.prompt_ids), StopStringMatcher(request.params.stop),
            request.params, sink, request.arrival_s,
        )
        self.scheduler.add(seq)

    def _abort(self, seq_id: int) -> None:
        live = self._live.pop(seq_id, None)
        seq = self.scheduler.abort(seq_id)
        if seq is None:
            return  # already finished
        if seq.status in (SequenceStatus.RUNNING, SequenceStatus.PARKED):
            self.engine.cache.free_sequence(seq_id)
        seq.status = SequenceStatus.FINISHED
        if live is not None:
            self.metrics.count_finished("abort")

    def _step(self) -> None:
        plan = self.scheduler.schedule()
        self._apply(plan)
        if not plan.scheduled:
            return
        engine = self.engine
        entries, input_ids, sample_rows, to_sample = [], [], [], []
        num_prefill_tokens = 0
        for seq, n in plan.scheduled:
            start = seq.num_computed_tokens
            entries.append((seq.seq_id, start, n))
            input_ids.extend(seq.token_ids(start, start + n))
            if start < len(seq.prompt_ids) or n > 1:
                num_prefill_tokens += n
            if start + n == seq.num_tokens:  # the forward reaches the sequence's last token: sample the next
                sample_rows.append(len(input_ids) - 1)
                to_sample.append(seq)
        batch = ForwardBatch.build(entries, engine.device)
        try:
            logits = engine.model(torch.tensor(input_ids, dtype=torch.long, device=engine.device), engine.cache,
                                  batch, logits_indices=torch.tensor(sample_rows, dtype=torch.long,
                                                                     device=engine.device))
            engine.cache.commit(batch)
        except CapacityError as e:
            # A level filled up although the budget said it would not (e.g. the disk): the batch's sequences fail
            # with the reason; the engine and everyone else go on.
            logger.error("KV capacity exceeded during a step: %s", e)
            for seq, _ in plan.scheduled:
                live = self._live.get(seq.seq_id)
                if live is not None:
                    self._fail(live, f"the KV cache ran out of room: {e}")
            return
        self.scheduler.complete_step(plan)
        self.metrics.prompt_tokens.inc(num_prefill_tokens)
        self._stats.record(prompt_tokens=num_prefill_tokens)
        if not to_sample:
            return
        greedy = logits.argmax(dim=-1).tolist()  # one op for every greedy sequence
        now = time.perf_counter()
        for row, seq in enumerate(to_sample):
            live = self._live[seq.seq_id]
            token = greedy[row] if live.params.is_greedy else live.sampler.sample(logits[row])
            self._postprocess(live, token, now)

    def _apply(self, plan: StepPlan) -> None:
        """Carry the plan's preemptions and admissions out on the cache, freeing before allocating."""
        cache = self.engine.cache
        for seq in plan.demoted:
            cache.demote_sequence(seq.seq_id)
        for seq in plan.recomputed:
            cache.free_sequence(seq.seq_id)
        for seq in plan.promoted:
            cache.promote_sequence(seq.seq_id)
        for seq in plan.admitted:
            cache.add_sequence(seq.seq_id)
        if plan.demoted:
            self.metrics.count_preemption("demote", len(plan.demoted))
        if plan.recomputed:
            self.metrics.count_preemption("recompute", len(plan.recomputed))
        if plan.num_preempted:
            self._stats.record(preemptions=plan.num_preempted)
            logger.debug("preempted %d sequence(s): %d demoted, %d to recompute", plan.num_preempted,
                         len(plan.demoted), len(plan.recomputed))

    def _postprocess(self, live: _Live, token: int, now: float) -> None:
        seq = live.seq
        seq.output_ids.append(token)
        if live.last_token_s is None:
            self.metrics.time_to_first_token.observe(now - live.arrival_s)
        else:
            self.metrics.inter_token_latency.observe(now - live.last_token_s)
        live.last_token_s = now
        self.metrics.generation_tokens.inc()
        self._stats.record(generation_tokens=1)
        finish, text = None, ""
        if token in self.engine.tokenizer.eos_token_ids and not live.params.ignore_eos:
            finish = "stop"
        else:
            text = live.stopper.feed(live.detok.add(token))
            if live.stopper.stopped:
                finish = "stop"
        if finish is None and (len(seq.output_ids) >= seq.max_tokens or seq.num_tokens >= self.engine.max_seq_len):
            finish = "length"
        if finish is not None:
            if not live.stopper.stopped:
                text += live.stopper.feed(live.detok.flush()) + live.stopper.flush()
            # Free before telling the client, so a finished response never leaves blocks behind.
            self.scheduler.finish(seq)
            self.engine.cache.free_sequence(seq.seq_id)
            del self._live[seq.seq_id]
            self.metrics.e2e_request_latency.observe(now - live.arrival_s)
            self.metrics.count_finished(finish)
        self._outbox.append((live.sink, SequenceOutput(live.index, text, 1, finish)))

    def _fail(self, live: _Live, message: str) -> None:
        seq = self.scheduler.abort(live.seq.seq_id) if self.scheduler else None
        if seq is not None and seq.status in (SequenceStatus.RUNNING, SequenceStatus.PARKED):
            self.engine.cache.free_sequence(seq.seq_id)
        self._live.pop(live.seq.seq_id, None)
        self.metrics.count_finished("error")
        self._outbox.append((live.sink, SequenceOutput(live.index, "", 0, None, error=message)))

    def _publish(self) -> None:
        """Refresh the gauges and the KV snapshot; maybe write the periodic stats line."""
        s = self.scheduler
        stats = dict(self.engine.cache.stats())
        self.kv_stats = stats
        self.metrics.publish_kv(stats)
        self.metrics.num_requests_running.set(s.num_running)
        self.metrics.num_requests_waiting.set(s.num_waiting)
        self.metrics.num_requests_parked.set(len(s.parked))
        self._stats.maybe_log(s.num_running, s.num_waiting, stats)


def kv_budget(engine: Any) -> KVBudget:
    """The scheduler's view of the engine's KV levels: capacities in blocks and the placement policy."""
    cache = engine.cache
    if isinstance(cache, TieredKVCache):
        cfg = cache.cfg
        capacity = {level: alloc.num_slots for level, alloc in cache.blocks.allocators.items()}
        return KVBudget(cfg.block_size, cfg.active_window, cfg.warm_tokens, cfg.num_sink_blocks, capacity,
                        cfg.max_num_seqs)
    # The contiguous baseline grows one tensor per sequence: only the number of live sequences is bounded.
    return KVBudget(16, 0, 0, 0, {}, engine.config.max_num_seqs)

