"""StepCosts: what a decode step costs with and without drafts, learned from the steps themselves,
and the number of drafts that makes tokens come fastest.

A step that drafts K tokens costs K draft tokens (the proposer's time) plus a verification of
K + 1 rows (the target's one-token step plus K extra rows), and emits the kept drafts plus one:
1 + a + ... + a^K tokens on average for an acceptance a per draft (drafts are kept in order until
the first rejection). Plain decoding emits one token per one-token step. Drafting pays only where

    (1 + a + ... + a^K) / (plain + K * (row + draft))  >  1 / plain

Where one verification row costs a large part of a one-token step (a CPU's decode GEMV bound
by its multiply-adds, not by reading the weights) and a draft model's step a third of the
target's, only a high acceptance pays, and drafting at a lower one slows decoding down. The
costs are running averages over single-sequence steps (a batch's step time is not one
sequence's; until a plain step has been timed alone, drafts follow the acceptance alone); each
sequence's acceptance is the Speculator's."""

from __future__ import annotations

from dataclasses import dataclass

# Weight of the newest observation in each running average.
COST_WEIGHT = 0.2
# Acceptances are clipped below 1: a perfect record so far is no promise.
MAX_ACCEPTANCE = 0.98


def expected_tokens(acceptance: float, num_drafts: int) -> float:
    """Tokens one verification emits on average: the kept drafts (in order, until the first
    rejection) plus the target's own."""
    a = min(max(acceptance, 0.0), MAX_ACCEPTANCE)
    return sum(a**i for i in range(num_drafts + 1))


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - COST_WEIGHT) * old + COST_WEIGHT * new


@dataclass
class StepCosts:
    """Running averages, in seconds, of a one-token decode forward, of each verified row past the
    first, and of the proposer's time per drafted token. None until observed."""

    plain_s: float | None = None
    row_s: float | None = None
    draft_s: float | None = None

    def observe_plain(self, seconds: float) -> None:
        self.plain_s = _average(self.plain_s, seconds)

    def observe_verification(self, seconds: float, rows: int) -> None:
        """A verification forward of `rows` rows (the last token and its drafts) took `seconds`;
        its rows past the first are what it cost beyond a plain step."""
        if self.plain_s is None or rows < 2:
            return
        self.row_s = _average(self.row_s, max(0.0, seconds - self.plain_s) / (rows - 1))

    def observe_drafting(self, seconds: float, num_drafts: int) -> None:
        if num_drafts > 0:
            self.draft_s = _average(self.draft_s, seconds / num_drafts)

    def tokens_per_s(self, acceptance: float, num_drafts: int) -> float:
        """Expected decode speed with `num_drafts` drafts a step (0: plain decoding); the costs
        not yet observed count as free, so the first steps try drafting."""
        assert self.plain_s is not None
        extra = (self.row_s or 0.0) + (self.draft_s or 0.0)
        return expected_tokens(acceptance, num_drafts) / (self.plain_s + num_drafts * extra)

    def best_drafts(self, acceptance: float, limit: int) -> int:
        """The number of drafts (0 to `limit`) expected to emit tokens fastest (a plain step must
        have been timed)."""
        assert self.plain_s is not None
        if self.plain_s <= 0.0:
            return limit
        speeds = [self.tokens_per_s(acceptance, k) for k in range(limit + 1)]
        return max(range(limit + 1), key=lambda k: (speeds[k], -k))
