"""OutputGate: generated text reaches a client only after the guardrail has checked it.

Each gated sequence's outputs are held as the core produces them. Once `chunk_tokens` tokens are
held (or the sequence ends) their text, after the previous chunk's text for context, goes to the
guardrail pool as one check, while decoding goes on; the outputs it covers are released when the
check passes or times out (skipped, counted once, not retried), and the sequence ends with
finish_reason "content_filter" when it flags (its held text withheld; its KV freed by the core).
At most one check per sequence is in flight, so outputs leave in order. Everything here runs on
the engine's thread: the pool's threads only classify."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from flashmemory.engine.observer import StepObserver
from flashmemory.engine.request import SequenceOutput, Sink
from flashmemory.guardrail.classifier import Verdict
from flashmemory.guardrail.pool import Check, GuardrailPool

CONTENT_FILTER = "content_filter"  # OpenAI's finish_reason for an output a filter stopped
CONTEXT_CHARS = 400  # of the text already checked, what the next check sees before its own
IDLE_WAIT_S = 0.005  # how long the core waits for a verdict when it has nothing else to run


@dataclass(eq=False)
class GatedSink:
    """One sequence's sink behind the gate, with what it holds back."""

    seq_id: int
    sink: Sink
    held: list[SequenceOutput] = field(default_factory=list)
    covered: int = 0  # held[:covered] are what the check in flight covers
    check: Check | None = None
    checked_text: str = ""  # the text the check in flight covers (context excluded)
    context: str = ""
    finish_report: tuple[str, float | None] | None = None  # the core's finish, told on release

    def __call__(self, output: SequenceOutput) -> None:
        """Straight to the client: for failures delivered outside a step (the engine stopping),
        which pass the gate anyway."""
        self.sink(output)


class OutputGate:
    """The gated sequences of one engine core."""

    def __init__(self, pool: GuardrailPool, chunk_tokens: int, on_error: str,
                 observer: StepObserver) -> None:
        self.pool = pool
        self.chunk_tokens = chunk_tokens
        self.block_on_error = on_error == "block"
        self.observer = observer
        self._streams: dict[int, GatedSink] = {}

    def wrap(self, seq_id: int, sink: Sink) -> GatedSink:
        stream = GatedSink(seq_id, sink)
        self._streams[seq_id] = stream
        return stream

    def forget(self, seq_id: int) -> None:
        """The sequence was aborted: nothing more of it is delivered."""
        self._streams.pop(seq_id, None)

    @property
    def pending(self) -> bool:
        return any(s.held for s in self._streams.values())

    def wait(self, timeout_s: float = IDLE_WAIT_S) -> None:
        self.pool.wait([s.check for s in self._streams.values() if s.check is not None], timeout_s)

    def route(self, deliveries: list[tuple[Sink, SequenceOutput]]
              ) -> tuple[list[tuple[Sink, SequenceOutput]], list[int]]:
        """The deliveries to make now (ungated ones as they are, gated ones as their checks
        clear them), and the live sequences a verdict ended (for the core to free)."""
        out: list[tuple[Sink, SequenceOutput]] = []
        for sink, output in deliveries:
            if not isinstance(sink, GatedSink):
                out.append((sink, output))
            elif output.error is not None:  # a failure ends it now; what it held is dropped
                self._streams.pop(sink.seq_id, None)
                out.append((sink.sink, output))
            elif sink.seq_id in self._streams:
                sink.held.append(output)
                self._submit(sink, out)
        ended: list[int] = []
        now = time.perf_counter()
        for stream in list(self._streams.values()):
            if stream.check is not None:
                verdict = self.pool.poll(stream.check, now)
                if verdict is not None:
                    self._decide(stream, verdict, out, ended)
        return out, ended

    def _submit(self, stream: GatedSink, out: list[tuple[Sink, SequenceOutput]]) -> None:
        if stream.check is not None or not stream.held:
            return
        final = stream.held[-1].finish_reason is not None
        if not final and sum(o.num_new_tokens for o in stream.held) < self.chunk_tokens:
            return
        text = "".join(o.text for o in stream.held)
        if not text.strip():  # nothing a classifier could flag
            self._release(stream, len(stream.held), out)
            return
        stream.check = self.pool.submit(stream.context + text)
        stream.covered, stream.checked_text = len(stream.held), text

    def _decide(self, stream: GatedSink, verdict: Verdict,
                out: list[tuple[Sink, SequenceOutput]], ended: list[int]) -> None:
        self.observer.on_guardrail(verdict.result, verdict.latency_s)
        stream.check = None
        if verdict.releases or (verdict.result == "error" and not self.block_on_error):
            stream.context = (stream.context + stream.checked_text)[-CONTEXT_CHARS:]
            self._release(stream, stream.covered, out)
            if stream.seq_id in self._streams:
                self._submit(stream, out)
            return
        # Flagged (or an error under guardrail_on_error=block): the held text is withheld.
        del self._streams[stream.seq_id]
        last = stream.held[-1]
        finished = last.finish_reason is not None
        filtered = SequenceOutput(last.index, "", 0, CONTENT_FILTER, stop_reason=verdict.describe(),
                                  produced_s=last.produced_s, kv_stats=last.kv_stats,
                                  kv_snapshot=last.kv_snapshot)
        self.observer.on_finished(CONTENT_FILTER, None)
        if not finished:
            ended.append(stream.seq_id)
        out.append((stream.sink, filtered))

    def _release(self, stream: GatedSink, n: int, out: list[tuple[Sink, SequenceOutput]]) -> None:
        released, stream.held, stream.covered = stream.held[:n], stream.held[n:], 0
        out.extend((stream.sink, o) for o in released)
        if released and released[-1].finish_reason is not None:
            del self._streams[stream.seq_id]
            if stream.finish_report is not None:
                self.observer.on_finished(*stream.finish_report)
