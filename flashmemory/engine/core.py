"""EngineCore: the one token loop. Each step the scheduler picks who runs (continuous batching by the memory each
KV level has left), the cache carries out its preemptions and admissions, one batched forward extends every
scheduled sequence, and the sequences that reached their last token sample, detokenize and report.

The Python API (FlashMemoryEngine) and the server's engine thread both drive it: `add` sequences, call `step`,
deliver the outputs it returns to the sinks they were added with. It is used from one thread at a time.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from flashmemory.engine.observer import NullObserver, StepObserver
from flashmemory.engine.output_gate import GatedSink, OutputGate
from flashmemory.engine.request import SequenceOutput, SequenceRequest, Sink
from flashmemory.engine.sampling import Sampler
from flashmemory.engine.scheduler import Scheduler, StepPlan
from flashmemory.engine.scheduling_policy import FCFS, SchedulingPolicy
from flashmemory.engine.sequence import Sequence, SequenceStatus
from flashmemory.engine.speculative.proposal import Proposal
from flashmemory.engine.speculative.speculator import Speculator
from flashmemory.engine.stop import StopStringMatcher
from flashmemory.errors import CapacityError, ColdBlockError, ColdZoneWriteError, DeviceLostError, FlashMemoryError
from flashmemory.guardrail.pool import GuardrailPool
from flashmemory.kvcache.interface import ForwardBatch, KVCache
from flashmemory.model.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)

Delivery = tuple[Sink, SequenceOutput]
# Failures of one sequence's KV that recomputing it from its tokens repairs (the damaged block is dropped with it,
# a transient write error may not come back). A level that is full (CapacityError, a full disk) is not repaired by
# recomputing: that sequence fails with the setting to change.
RECOVERABLE = (ColdBlockError, ColdZoneWriteError)
MAX_RECOMPUTES = 1  # a sequence that faults again after being recomputed fails (the disk may be broken for good)


def is_fatal(error: BaseException, device: torch.device) -> bool:
    """Errors after which the engine cannot go on: the device is lost (a CUDA error poisons the context)."""
    if isinstance(error, (KeyboardInterrupt, SystemExit, DeviceLostError)):
        return True
    message = str(error)
    return device.type == "cuda" and isinstance(error, RuntimeError) and (
        "CUDA error" in message or "device-side assert" in message or "ECC" in message)


def _client_message(error: BaseException) -> str:
    """What the client is told: our typed errors say what happened; anything else only its kind."""
    if isinstance(error, FlashMemoryError):
        return str(error)
    return f"{type(error).__name__} while generating; the server log has the details"


@dataclass
class _Live:
    """Core state of one sequence besides what the scheduler tracks."""

    seq: Sequence
    request: SequenceRequest
    sampler: Sampler
    detok: IncrementalDetokenizer
    stopper: StopStringMatcher
    sink: Sink
    first_forward_s: float | None = None
    last_token_s: float | None = None


class EngineCore:
    """Owns the scheduler and every live sequence; runs batched steps of the model over the KV cache."""

    def __init__(self, model: torch.nn.Module, cache: KVCache, tokenizer: Tokenizer, max_seq_len: int,
                 device: torch.device, max_num_batched_tokens: int, observer: StepObserver | None = None,
                 policy: SchedulingPolicy = FCFS, speculator: Speculator | None = None,
                 guardrail: GuardrailPool | None = None, guardrail_chunk_tokens: int = 16,
                 guardrail_on_error: str = "pass") -> None:
        self.model = model
        self.cache = cache
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self.device = device
        self.observer: StepObserver = observer or NullObserver()
        self.speculator = speculator  # None: one token per sequence and step
        self.scheduler = Scheduler(cache.kv_capacity(), max_num_batched_tokens, policy)
        # With a guardrail, generated text waits for its checks (engine/output_gate.py).
        self.gate = None if guardrail is None else OutputGate(
            guardrail, guardrail_chunk_tokens, guardrail_on_error, self.observer)
        self._live: dict[int, _Live] = {}
        self._refused: list[Delivery] = []  # sequences that can never fit, reported by the next step
        self._seq_ids = itertools.count()

    # ---- sequences in and out ---------------------------------------------------------------------------------

    def next_seq_id(self) -> int:
        return next(self._seq_ids)

    def add(self, request: SequenceRequest, sink: Sink, seq_id: int | None = None) -> int:
        """Queue a sequence; its outputs will go to `sink` (through `step`'s return value). Returns its id."""
        seq_id = self.next_seq_id() if seq_id is None else seq_id
        max_tokens = min(request.params.max_new_tokens, self.max_seq_len - len(request.prompt_ids))
        seq = Sequence(seq_id, list(request.prompt_ids), max_tokens, pinned_spans=tuple(request.pinned_spans))
        reason = self.unfit_reason(len(seq.prompt_ids) + max_tokens, seq.pinned_spans)
        if reason is not None:  # it would wait forever: refuse it now, with the setting to change
            error = CapacityError(reason)
            self._refused.append((sink, SequenceOutput(request.index, "", 0, None, error=reason, exception=error)))
            self.observer.on_finished("error", None)
            return seq_id
        if not seq.skip_prefix_reuse:
            self._import_shared(seq.prompt_ids)
        if self.gate is not None:
            sink = self.gate.wrap(seq_id, sink)
        self._live[seq_id] = _Live(seq, request, Sampler(request.params, self.device),
                                   IncrementalDetokenizer(self.tokenizer, request.prompt_ids),
                                   StopStringMatcher(request.params.stop), sink)
        self.scheduler.add(seq)
        return seq_id

    def _import_shared(self, prompt_ids: list[int]) -> None:
        """The prompt's blocks a shared level holds past the local prefix become cached blocks
        here before it is scheduled (each network call bounded by remote_kv_timeout_ms)."""
        try:
            self.cache.import_shared_prefix(prompt_ids)
        except Exception as e:  # noqa: BLE001 - an optimisation: the prompt is computed instead
            if is_fatal(e, self.device):
                raise
            logger.error("reading the shared KV level failed (%s: %s); the prompt is computed",
                         type(e).__name__, e, exc_info=True)

    def abort(self, seq_id: int) -> None:
        """Stop a sequence and free its KV on every level; no more outputs are sent for it."""
        live = self._live.pop(seq_id, None)
        if self.gate is not None:
            self.gate.forget(seq_id)
        seq = self.scheduler.abort(seq_id)
        if seq is None:
            return  # already finished
        self._release(seq)
        if live is not None:
            self.observer.on_finished("abort", None)

    def has_work(self) -> bool:
        return (bool(self._refused) or self.scheduler.has_work()
                or (self.gate is not None and self.gate.pending))

    @property
    def num_live(self) -> int:
        return len(self._live)

    def live_seq_ids(self) -> list[int]:
        return list(self._live)

    # ---- one step ---------------------------------------------------------------------------------------------

    def step(self) -> list[Delivery]:
        """Schedule, run one batched forward, sample; returns the outputs to deliver, in order
        (with a guardrail, those its checks have cleared)."""
        out = self._step()
        if self.gate is None:
            return out
        if not out and not self.scheduler.has_work():
            self.gate.wait()  # nothing to run: give the checks in flight a moment
        out, ended = self.gate.route(out)
        for seq_id in ended:  # flagged while generating: stop it and free its KV
            seq = self.scheduler.abort(seq_id)
            self._live.pop(seq_id, None)
            if seq is not None:
                self._release(seq)
        return out

    def _step(self) -> list[Delivery]:
        out, self._refused = self._refused, []
        plan = self.scheduler.schedule()
        out += self._apply(plan)
        if not plan.scheduled:
            return out
        proposals = self._draft(plan)
        entries, input_ids, sample_rows, to_sample = [], [], [], []
        num_prefill_tokens = 0
        started = time.perf_counter()
        for seq, n in plan.scheduled:
            start = seq.num_computed_tokens
            tokens = seq.token_ids(start, start + n)
            if start < len(seq.prompt_ids) or n > 1:
                num_prefill_tokens += n
            proposal = proposals.get(seq.seq_id)
            if proposal is not None:  # the last token and its drafts, each read as a decode step
                tokens = tokens + proposal.tokens
            entries.append((seq.seq_id, start, len(tokens), tokens))
            input_ids.extend(tokens)
            live = self._live[seq.seq_id]
            if live.first_forward_s is None:
                live.first_forward_s = started
            if start + n == seq.num_tokens:  # the forward reaches the sequence's last token: sample the next
                rows = 1 if proposal is None else len(tokens)
                to_sample.append((seq, len(sample_rows), rows))
                sample_rows.extend(range(len(input_ids) - rows, len(input_ids)))
        batch = ForwardBatch.build(entries, self.device, as_decode=proposals.keys())
        try:
            logits = self.model(torch.tensor(input_ids, dtype=torch.long, device=self.device), self.cache, batch,
                                logits_indices=torch.tensor(sample_rows, dtype=torch.long, device=self.device))
        except Exception as e:  # noqa: BLE001 - contained: the culprit fails or is recomputed, the others retry
            self.cache.rollback(batch)
            for seq_id in proposals:
                self.speculator.settle(self._live[seq_id].seq)  # nothing drafted was kept
            return out + self._contain(e, [seq for seq, _ in plan.scheduled])
        if self.speculator is not None and len(plan.scheduled) == 1 and not num_prefill_tokens:
            # one sequence's decode step alone: what a step (or a verification) costs
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the forward's kernels, not their launches
            self.speculator.observe_step(time.perf_counter() - started, len(input_ids))
        emitted = self._verify(proposals, to_sample, logits)
        # Of a verification: the last token and the kept drafts (the last token alone where it
        # failed).
        kept = {seq_id: len(emitted[seq_id]) if seq_id in emitted else 1 for seq_id in proposals}
        for i, (seq, _) in enumerate(plan.scheduled):
            try:
                self.cache.commit(batch.only(i), kept if seq.seq_id in kept else None)
            except Exception as e:  # noqa: BLE001 - this sequence's KV is in doubt: only it is affected
                out += self._contain(e, [seq])
        # A sequence whose commit failed was requeued (waiting) or failed (gone): the rest completed the step.
        plan.scheduled = [(seq, kept.get(seq.seq_id, n)) for seq, n in plan.scheduled
                          if seq.seq_id in self._live and seq.status == SequenceStatus.RUNNING]
        self.scheduler.complete_step(plan)
        self.observer.on_prefill_tokens(num_prefill_tokens)
        for seq, _ in plan.scheduled:
            progress = self._live[seq.seq_id].request.progress
            if progress is not None and seq.num_computed_tokens <= len(seq.prompt_ids):
                progress(seq.num_computed_tokens, len(seq.prompt_ids))
        done = {seq.seq_id for seq, _ in plan.scheduled}
        greedy = logits.argmax(dim=-1).tolist() if to_sample else []  # one op for every greedy sequence
        now = time.perf_counter()
        for seq, row, _ in to_sample:
            if seq.seq_id not in done:
                continue
            live = self._live[seq.seq_id]
            try:
                if seq.seq_id in emitted:
                    out += self._emit(live, emitted[seq.seq_id], now)
                    continue
                token = greedy[row] if live.request.params.is_greedy else live.sampler.sample(logits[row])
                out.append(self._postprocess(live, token, now))
            except Exception as e:  # noqa: BLE001 - a sampling failure ends this sequence alone
                logger.error("sequence %d failed while sampling: %s", seq.seq_id, e, exc_info=True)
                out.append(self._fail(live, _client_message(e), e))
        return out

    # ---- speculative decoding -------------------------------------------------------------------

    def _draft(self, plan: StepPlan) -> dict[int, Proposal]:
        """Drafts for the plan's decode steps, as many as one verification may carry for each."""
        if self.speculator is None:
            return {}
        proposals = {}
        for seq, n in plan.scheduled:
            start = seq.num_computed_tokens
            if start < len(seq.prompt_ids):  # prefill: nothing to draft; the drafter reads along
                self.speculator.follow(seq, start + n)
                continue
            if n != 1 or start != seq.num_tokens - 1:
                continue
            # The verification's tokens stay within the filling block and complete no block (the
            # scheduler reserved for one token); the emitted ones within max_tokens and the
            # context.
            room = min(self.cache.max_decode_rows(seq.seq_id) - 2,
                       seq.max_tokens - len(seq.output_ids) - 1, self.max_seq_len - seq.num_tokens)
            proposal = self.speculator.propose(seq, self._live[seq.seq_id].sampler, room)
            if proposal is not None:
                proposals[seq.seq_id] = proposal
        return proposals

    def _verify(self, proposals: dict[int, Proposal], to_sample: list[tuple[Sequence, int, int]],
                logits: torch.Tensor) -> dict[int, list[int]]:
        """Per drafted sequence, the tokens to emit (their count is the forward's tokens kept); a
        sequence whose verification fails keeps its first token and samples it as usual."""
        emitted = {}
        for seq, row, rows in to_sample:
            proposal = proposals.get(seq.seq_id)
            if proposal is None:
                continue
            try:
                emitted[seq.seq_id] = self.speculator.verify(
                    seq.seq_id, proposal, logits[row : row + rows], self._live[seq.seq_id].sampler)
            except Exception as e:  # noqa: BLE001 - this sequence goes on without its drafts
                self.speculator.fail(seq.seq_id, e)
        return emitted

    def _emit(self, live: _Live, tokens: list[int], now: float) -> list[Delivery]:
        """A verification's tokens, one output each, until the sequence finishes."""
        out = []
        for token in tokens:
            out.append(self._postprocess(live, token, now))
            if live.seq.seq_id not in self._live:
                return out  # finished (its draft state went with it)
        self.speculator.settle(live.seq)
        return out

    def _forget_draft(self, seq_id: int) -> None:
        if self.speculator is not None:
            self.speculator.release(seq_id)

    def _contain(self, error: Exception, involved: list[Sequence]) -> list[Delivery]:
        """A step failed. A fatal error (the device is lost) propagates; otherwise the sequence it names (or, when
        it names none, every sequence involved) is recomputed once or failed; the rest simply run again."""
        if is_fatal(error, self.device):
            raise error
        culprit = getattr(error, "seq_id", None)
        hit = [seq for seq in involved if seq.seq_id == culprit] or involved
        logger.error("a step failed for sequence(s) %s: %s: %s", [s.seq_id for s in hit], type(error).__name__,
                     error, exc_info=not isinstance(error, FlashMemoryError))
        out = []
        for seq in hit:
            live = self._live.get(seq.seq_id)
            if live is None:
                continue
            seq.num_faults += 1
            if isinstance(error, RECOVERABLE) and seq.num_faults <= MAX_RECOMPUTES:
                self.cache.free_sequence(seq.seq_id, keep_cached=False)  # its KV (the damaged block too) goes
                self._forget_draft(seq.seq_id)
                self.scheduler.requeue(seq)
                self.observer.on_fault("recompute")
            else:
                out.append(self._fail(live, _client_message(error), error))
                self.observer.on_fault("fail")
        return out

    def _apply(self, plan: StepPlan) -> list[Delivery]:
        """Carry the plan's preemptions and admissions out on the cache, freeing before allocating.
        A sequence whose admission fails (a cached block it reuses cannot be read) is contained
        alone and leaves the plan; returns the outputs of those that failed."""
        cache, out = self.cache, []
        for seq in plan.demoted:
            cache.demote_sequence(seq.seq_id)
            self._forget_draft(seq.seq_id)  # the draft reads it again when it runs again
        for seq in plan.recomputed:
            cache.free_sequence(seq.seq_id)
            self._forget_draft(seq.seq_id)
        for seq in plan.promoted:
            cache.promote_sequence(seq.seq_id)
        for seq in plan.admitted:
            try:
                self._admit(seq)
            except Exception as e:  # noqa: BLE001 - contained: recomputed, or it fails alone
                out += self._contain_admission(e, seq)
        if out or any(seq.status != SequenceStatus.RUNNING for seq in plan.admitted):
            plan.scheduled = [(seq, n) for seq, n in plan.scheduled
                              if seq.seq_id in self._live and seq.status == SequenceStatus.RUNNING]
        if plan.demoted:
            self.observer.on_preempted("demote", len(plan.demoted))
        if plan.recomputed:
            self.observer.on_preempted("recompute", len(plan.recomputed))
        if plan.num_preempted:
            logger.debug("preempted %d sequence(s): %d demoted, %d to recompute", plan.num_preempted,
                         len(plan.demoted), len(plan.recomputed))
        return out

    def _admit(self, seq: Sequence) -> None:
        """Give an admitted sequence its place in the cache and the prefix the scheduler counted."""
        cache = self.cache
        cache.add_sequence(seq.seq_id)
        if not seq.skip_prefix_reuse:
            # a lookup, hit or miss
            reused = cache.reuse_prefix(seq.seq_id, seq.token_ids(0, seq.num_tokens))
            # NOTE: nothing between the scheduler's lookup and this attach evicts a whole block
            # (only L0 copies of unused ones go), so the cache finds what the scheduler counted.
            assert reused == seq.num_cached_prefix_tokens, (reused, seq.num_cached_prefix_tokens)
        for start, end in seq.pinned_spans:
            cache.pin_span(seq.seq_id, start, end)

    def _contain_admission(self, error: Exception, seq: Sequence) -> list[Delivery]:
        """Admitting `seq` failed. Its KV is freed (the prefix blocks it reused stay cached; a block
        that could not be read already left the cache) and it waits to be computed again, once;
        then it fails alone."""
        if is_fatal(error, self.device):
            raise error
        logger.error("admitting sequence %d failed: %s: %s", seq.seq_id, type(error).__name__,
                     error, exc_info=not isinstance(error, FlashMemoryError))
        self.cache.free_sequence(seq.seq_id)
        self._forget_draft(seq.seq_id)
        live = self._live.get(seq.seq_id)
        seq.num_faults += 1
        if live is not None and isinstance(error, RECOVERABLE + (CapacityError,)) \
                and seq.num_faults <= MAX_RECOMPUTES:
            # Computed again from its tokens alone: the block that failed left the cache, but the
            # older blocks of the same prefix are read only later, by decode steps, and may be as
            # damaged (a truncated file); a full level while restoring it would fail the same way.
            seq.skip_prefix_reuse = True
            self.scheduler.requeue(seq)
            self.observer.on_fault("recompute")
            return []
        self.observer.on_fault("fail")
        if live is None:
            self.scheduler.abort(seq.seq_id)
            return []
        return [self._fail(live, _client_message(error), error)]

    def _postprocess(self, live: _Live, token: int, now: float) -> Delivery:
        seq, params = live.seq, live.request.params
        seq.output_ids.append(token)
        first = live.last_token_s is None
        self.observer.on_token(now - (live.request.arrival_s if first else live.last_token_s), first)
        live.last_token_s = now
        finish, text, token_id = None, "", token
        if token in self.tokenizer.eos_token_ids and not params.ignore_eos:
            finish, token_id = "stop", None
        else:
            text = live.stopper.feed(live.detok.add(token))
            if live.stopper.stopped:
                finish = "stop"
        if finish is None and (len(seq.output_ids) >= seq.max_tokens or seq.num_tokens >= self.max_seq_len):
            finish = "length"
        output = SequenceOutput(live.request.index, text, 1, finish, token_id=token_id, produced_s=now,
                                first_forward_s=live.first_forward_s if first else None)
        if finish is not None:
            if not live.stopper.stopped:
                output.text += live.stopper.feed(live.detok.flush()) + live.stopper.flush()
            if live.request.capture_kv_stats:
                # as the sequence ends, before its blocks are freed
                output.kv_snapshot = self.cache.kv_stats()
                output.kv_stats = output.kv_snapshot.as_dict()
            # Free before telling the client, so a finished response never leaves blocks behind.
            self.scheduler.finish(seq)
            self.cache.free_sequence(seq.seq_id)
            self._forget_draft(seq.seq_id)
            del self._live[seq.seq_id]
            if isinstance(live.sink, GatedSink):  # told when the guardrail releases it
                live.sink.finish_report = (finish, now - live.request.arrival_s)
            else:
                self.observer.on_finished(finish, now - live.request.arrival_s)
        return live.sink, output

    def _fail(self, live: _Live, message: str, exception: BaseException | None = None) -> Delivery:
        seq = self.scheduler.abort(live.seq.seq_id)
        if seq is not None:
            self._release(seq, keep_cached=False)  # what failed may be its KV: nothing of it is reused
        self._live.pop(live.seq.seq_id, None)
        self.observer.on_finished("error", None)
        return live.sink, SequenceOutput(live.request.index, "", 0, None, error=message, exception=exception)

    def fail_all(self, message: str) -> list[Delivery]:
        """Fail every live sequence (the engine cannot go on); returns their error outputs."""
        out = []
        for live in list(self._live.values()):
            try:
                out.append(self._fail(live, message))
            except Exception:  # noqa: BLE001 - the cache may be what broke; the clients must still hear
                out.append((live.sink, SequenceOutput(live.request.index, "", 0, None, error=message)))
        self._live.clear()
        return out

    def _release(self, seq: Sequence, keep_cached: bool = True) -> None:
        self._forget_draft(seq.seq_id)
        if seq.status in (SequenceStatus.RUNNING, SequenceStatus.PARKED):
            self.cache.free_sequence(seq.seq_id, keep_cached)
        seq.status = SequenceStatus.FINISHED

    def unfit_reason(self, num_tokens: int, pinned_spans: Seq[tuple[int, int]] = ()) -> str | None:
        """Why a sequence that may reach `num_tokens` tokens can never run here; None when it can."""
        return self.scheduler.unfit_reason(num_tokens, tuple(pinned_spans))
