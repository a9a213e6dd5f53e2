"""OutputGate: text leaves only after a check clears it, in order, a chunk at a time; a flag
ends the output with content_filter; a timeout or (by setting) an error releases it."""

from __future__ import annotations

import pytest

from flashmemory.engine.observer import NullObserver
from flashmemory.engine.output_gate import CONTENT_FILTER, OutputGate
from flashmemory.engine.request import SequenceOutput
from flashmemory.guardrail.pool import GuardrailPool
from tests.guardrail.fakes import FlagWords, Raising, Slow
from tests.helpers import wait_for


class Recorder(NullObserver):
    def __init__(self) -> None:
        self.finished: list[str] = []
        self.checks: list[str] = []

    def on_finished(self, reason, e2e_s):
        self.finished.append(reason)

    def on_guardrail(self, result, latency_s):
        self.checks.append(result)


class Client:
    def __init__(self) -> None:
        self.got: list[SequenceOutput] = []

    def __call__(self, out):
        self.got.append(out)

    @property
    def text(self) -> str:
        return "".join(o.text for o in self.got)


@pytest.fixture
def gate_for():
    pools = []

    def make(classifier, chunk=2, on_error="pass", timeout_ms=500.0):
        pool = GuardrailPool(classifier, 0.5, timeout_ms)
        pools.append(pool)
        return OutputGate(pool, chunk, on_error, Recorder())

    yield make
    for pool in pools:
        pool.close()


def feed(gate, sink, outputs):
    """Route the outputs, then poll until the gate holds nothing; deliver; return the ended ids."""
    delivered, ended = gate.route([(sink, o) for o in outputs]) if outputs else ([], [])
    for s, o in delivered:
        s(o)
    ended_all = list(ended)

    def settle():
        out, more = gate.route([])
        for s, o in out:
            s(o)
        ended_all.extend(more)
        return not gate.pending

    assert wait_for(settle)
    return ended_all


def words(*pieces, finish_last="stop"):
    outs = [SequenceOutput(0, p, 1) for p in pieces]
    outs[-1].finish_reason = finish_last
    return outs


def test_text_is_released_after_its_check_in_order_and_each_check_sees_the_previous_chunk(gate_for):
    classifier = Slow(10.0, "idiot")  # answers when released
    gate = gate_for(classifier, chunk=2)
    client = Client()
    sink = gate.wrap(7, client)
    sink.finish_report = ("stop", 0.1)
    pieces = words("one ", "two ", "three ", "four", finish_last=None)
    assert gate.route([(sink, o) for o in pieces]) == ([], [])  # held: its check is in flight
    assert gate.route([(sink, o) for o in words(".")]) == ([], [])  # one check at a time
    classifier.release.set()
    feed(gate, sink, [])
    assert client.text == "one two three four." and client.got[-1].finish_reason == "stop"
    assert classifier.texts == ["one two ", "one two three four."]
    assert gate.observer.checks == ["pass"] * 2 and gate.observer.finished == ["stop"]


def test_a_flag_ends_the_output_with_content_filter_and_withholds_the_flagged_chunk(gate_for):
    gate = gate_for(FlagWords("idiot"), chunk=2)
    client = Client()
    sink = gate.wrap(3, client)
    ended = feed(gate, sink, words("hello ", "there ", "you ", "idiot", finish_last=None))
    assert ended == [3]  # still generating: the core frees it
    assert client.text == "hello there "
    last = client.got[-1]
    assert (last.finish_reason, last.stop_reason) == (CONTENT_FILTER, "guardrail: bad (1.00)")
    assert gate.observer.finished == [CONTENT_FILTER]
    delivered, _ = gate.route([(sink, SequenceOutput(0, "more", 1))])
    assert delivered == []  # nothing of it goes out after the flag


def test_a_flag_on_the_final_chunk_replaces_the_finish(gate_for):
    gate = gate_for(FlagWords("idiot"), chunk=8)
    client = Client()
    sink = gate.wrap(1, client)
    sink.finish_report = ("length", 0.2)
    ended = feed(gate, sink, words("you ", "idiot"))
    assert ended == []  # it had finished: nothing to free
    assert [o.finish_reason for o in client.got] == [CONTENT_FILTER] and client.text == ""
    assert gate.observer.finished == [CONTENT_FILTER]  # told once, not "length" too


def test_a_timed_out_check_releases_the_text_and_counts_one_timeout(gate_for):
    slow = Slow(10.0, "idiot")
    gate = gate_for(slow, chunk=8, timeout_ms=20.0)
    client = Client()
    sink = gate.wrap(1, client)
    feed(gate, sink, words("you ", "idiot"))
    slow.release.set()
    assert client.text == "you idiot" and client.got[-1].finish_reason == "stop"
    assert gate.observer.checks == ["timeout"] and gate.pool.stats.checks["timeout"] == 1


@pytest.mark.parametrize("on_error,text,reason", [("pass", "some text", "stop"),
                                                  ("block", "", CONTENT_FILTER)])
def test_a_classifier_error_passes_or_blocks_as_set(gate_for, on_error, text, reason):
    gate = gate_for(Raising(), chunk=8, on_error=on_error)
    client = Client()
    sink = gate.wrap(1, client)
    feed(gate, sink, words("some ", "text"))
    assert client.text == text and client.got[-1].finish_reason == reason
    assert gate.observer.checks == ["error"]


def test_whitespace_is_released_without_a_check_and_errors_pass_at_once(gate_for):
    classifier = FlagWords("x")
    gate = gate_for(classifier, chunk=8)
    client = Client()
    sink = gate.wrap(1, client)
    feed(gate, sink, words(" ", "\n"))
    assert classifier.texts == [] and client.text == " \n"
    other = Client()
    failing = gate.wrap(2, other)
    gate.route([(failing, SequenceOutput(0, "held", 1))])
    out, _ = gate.route([(failing, SequenceOutput(0, "", 0, error="boom"))])
    assert [o.error for _, o in out] == ["boom"] and not gate.pending


def test_an_aborted_sequence_is_forgotten(gate_for):
    gate = gate_for(FlagWords(), chunk=8)
    sink = gate.wrap(1, Client())
    gate.route([(sink, SequenceOutput(0, "held", 1))])
    assert gate.pending
    gate.forget(1)
    assert not gate.pending
