"""GuardrailPool: a verdict per check, decided once; a timeout counted once, never retried."""

from __future__ import annotations

import time

import pytest

from flashmemory.guardrail.classifier import judge
from flashmemory.guardrail.pool import GuardrailPool
from tests.guardrail.fakes import FlagWords, Raising, Slow
from tests.helpers import wait_for


@pytest.fixture
def pools():
    made = []

    def make(classifier, timeout_ms=200.0, threshold=0.5):
        pool = GuardrailPool(classifier, threshold, timeout_ms)
        made.append(pool)
        return pool

    yield make
    for pool in made:
        pool.close()


def decided(pool, check, timeout_s=5.0):
    assert wait_for(lambda: pool.poll(check) is not None, timeout_s)
    return pool.poll(check)


def test_judge_flags_the_top_label_at_or_over_the_threshold():
    assert judge({"a": 0.2, "b": 0.49}, 0.5, 0.0).result == "pass"
    v = judge({"a": 0.5, "b": 0.9, "c": 0.7}, 0.5, 0.01)
    assert (v.result, v.label, v.score) == ("flagged", "b", 0.9)
    assert v.describe() == "guardrail: b (0.90)"


def test_a_check_passes_or_flags_by_the_classifiers_scores(pools):
    pool = pools(FlagWords("idiot"))
    assert decided(pool, pool.submit("a kind sentence")).result == "pass"
    v = decided(pool, pool.submit("you idiot"))
    assert (v.result, v.label) == ("flagged", "bad")
    assert pool.stats.checks == {"pass": 1, "flagged": 1, "timeout": 0, "error": 0}


def test_a_check_slower_than_its_timeout_is_skipped_and_counted_once(pools):
    slow = Slow(10.0, "idiot")
    pool = pools(slow, timeout_ms=20.0)
    check = pool.submit("you idiot")
    v = decided(pool, check)
    assert v.result == "timeout" and v.releases
    slow.release.set()  # the answer comes late: it changes nothing
    assert wait_for(lambda: check.future.done())
    for _ in range(5):
        assert pool.poll(check) is v
    assert pool.stats.checks["timeout"] == 1 and pool.stats.checks["flagged"] == 0
    assert slow.calls == 1  # never retried


def test_an_answer_that_came_after_the_deadline_is_a_timeout_too(pools):
    pool = pools(Slow(0.05), timeout_ms=10.0)
    check = pool.submit("text")
    assert wait_for(lambda: check.future.done())
    assert pool.poll(check, now_s=check.submitted_s).result == "timeout"


def test_checks_queued_behind_a_stuck_one_time_out_and_never_run(pools):
    slow = Slow(10.0)
    pool = pools(slow, timeout_ms=20.0)  # one thread: the second check waits behind the first
    first, second = pool.submit("one"), pool.submit("two")
    time.sleep(0.05)
    assert pool.poll(second).result == "timeout"
    assert pool.poll(first).result == "timeout"
    slow.release.set()
    assert wait_for(lambda: first.future.done())
    assert second.future.cancelled() and slow.calls == 1


def test_a_classifier_that_raises_gives_an_error_verdict(pools):
    pool = pools(Raising())
    v = decided(pool, pool.submit("text"))
    assert v.result == "error" and "the classifier broke" in v.error
    assert pool.stats.as_dict()["guardrail_error"] == 1


def test_checks_run_with_one_torch_thread(pools):
    import torch

    class Threads(FlagWords):
        def scores(self, text):
            return {"bad": float(torch.get_num_threads())}

    pool = pools(Threads(), threshold=1.0)
    v = decided(pool, pool.submit("x"))
    assert (v.result, v.score) == ("flagged", 1.0)  # its own team of one, whatever the engine's
