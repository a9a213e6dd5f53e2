"""StepCosts and the cost-aware Speculator: the number of drafts that emits tokens fastest, none
where plain decoding is faster, every 16th step measuring the other way."""

from __future__ import annotations

import pytest

from flashmemory.engine.speculative.proposal import Proposal
from flashmemory.engine.speculative.speculator import PROBE_STEPS, Speculator
from flashmemory.engine.speculative.step_costs import StepCosts, expected_tokens


def _costs(plain: float, row: float, draft: float) -> StepCosts:
    costs = StepCosts()
    costs.observe_plain(plain)
    costs.observe_verification(plain + 3 * row, rows=4)
    costs.observe_drafting(2 * draft, num_drafts=2)
    return costs


def test_expected_tokens_counts_the_kept_drafts_in_order():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(1.0, 3) == pytest.approx(sum(0.98**i for i in range(4)))  # clipped


def test_averages_are_learned_from_the_steps():
    costs = _costs(plain=0.050, row=0.010, draft=0.020)
    assert costs.plain_s == pytest.approx(0.050)
    assert costs.row_s == pytest.approx(0.010)
    assert costs.draft_s == pytest.approx(0.020)
    costs.observe_plain(0.100)  # a running average, not the last value
    assert 0.050 < costs.plain_s < 0.100
    StepCosts().observe_verification(1.0, rows=3)  # no plain step yet: nothing to measure from


@pytest.mark.parametrize("plain,row,draft,acceptance", [
    (0.050, 0.001, 0.002, 0.9),  # cheap draft, cheap rows, high acceptance: draft many
    (0.050, 0.012, 0.025, 0.87),
    (0.050, 0.030, 0.030, 0.6),  # no K pays
    (0.050, 0.005, 0.0, 0.45),  # prompt lookup (free drafts), rows at a tenth of a step
    (0.050, 0.030, 0.0, 0.3),
])
def test_best_drafts_is_the_fastest_choice(plain, row, draft, acceptance):
    costs = _costs(plain, row, draft)
    best = costs.best_drafts(acceptance, 7)
    speeds = [expected_tokens(acceptance, k) / (plain + k * (row + draft)) for k in range(8)]
    assert speeds[best] == pytest.approx(max(speeds))
    assert (best == 0) == (max(speeds[1:]) <= speeds[0])


def test_drafting_loses_where_a_step_of_drafts_costs_more_than_it_emits():
    assert _costs(0.050, 0.030, 0.030).best_drafts(0.6, 4) == 0
    assert _costs(0.050, 0.001, 0.002).best_drafts(0.9, 4) == 4


class _Counting:
    """A proposer that drafts `limit` copies of token 1 and counts what it was asked."""

    name = "counting"

    def __init__(self) -> None:
        self.asked: list[int] = []

    def propose(self, seq, max_tokens, sampler):
        self.asked.append(max_tokens)
        return Proposal([1] * max_tokens)

    def follow(self, seq, num_tokens):
        pass

    def settle(self, seq):
        pass

    def release(self, seq_id):
        pass

    def close(self):
        pass


class _Seq:
    seq_id = 7


def test_a_paused_sequence_probes_every_16th_step_where_acceptance_could_pay():
    spec = Speculator(_Counting(), 4, adaptive=True, cost_aware=True)
    assert spec.drafts_for(7) == 0  # the first step is plain: it times one
    spec.observe_step(0.050, rows=1)
    assert spec.drafts_for(7) == 4  # unmeasured rows and drafts count as free
    # measured: cheap drafts, but this sequence's drafts are mostly rejected
    spec.costs = _costs(0.050, 0.005, 0.005)
    spec._acceptance[7] = 0.1
    counts = [spec.drafts_for(7) for _ in range(2 * PROBE_STEPS)]
    probes = [i for i, k in enumerate(counts) if k]
    assert len(probes) == 2 and all((i + 3) % PROBE_STEPS == 0 for i in probes)
    assert spec.stats.spec_decode_paused_steps == 2 * PROBE_STEPS - 2


def test_no_probe_where_even_every_draft_kept_would_not_pay():
    """A draft model that costs most of a target step: the probes (which make it catch up on
    every token it skipped) would only slow decoding down."""
    spec = Speculator(_Counting(), 4, adaptive=True, cost_aware=True)
    spec.costs = _costs(0.050, 0.030, 0.030)
    assert spec.costs.best_drafts(0.98, 4) == 0
    assert [spec.drafts_for(7) for _ in range(3 * PROBE_STEPS)] == [0] * (3 * PROBE_STEPS)
    assert spec.stats.spec_decode_paused_steps == 3 * PROBE_STEPS


def test_a_drafting_sequence_takes_a_plain_step_every_16th():
    spec = Speculator(_Counting(), 4, adaptive=True, cost_aware=True)
    spec.costs = _costs(0.050, 0.001, 0.002)
    counts = [spec.drafts_for(7) for _ in range(PROBE_STEPS)]
    assert counts.count(0) == 1 and counts[-1] == 0 and set(counts[:-1]) == {4}
    assert spec.stats.spec_decode_paused_steps == 0


def test_without_cost_aware_the_acceptance_alone_decides():
    for adaptive, cost_aware in ((True, False), (False, True)):
        spec = Speculator(_Counting(), 4, adaptive=adaptive, cost_aware=cost_aware)
        spec.costs = _costs(0.050, 0.030, 0.030)
        assert [spec.drafts_for(7) for _ in range(PROBE_STEPS)] == [4] * PROBE_STEPS


def test_propose_times_the_proposer():
    proposer = _Counting()
    spec = Speculator(proposer, 3, adaptive=True, cost_aware=True)
    spec.observe_step(0.050, rows=1)
    spec._steps[7] = 1
    proposal = spec.propose(_Seq(), sampler=None, room=8)
    assert proposal is not None and proposal.tokens == [1, 1, 1] and proposer.asked == [3]
    assert spec.costs.draft_s is not None and spec.costs.draft_s >= 0.0
    spec.observe_step(0.080, rows=4)
    assert spec.costs.row_s == pytest.approx(0.010)
