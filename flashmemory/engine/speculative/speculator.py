"""Speculator: the engine core's one handle on speculative decoding. It asks the proposer for a
sequence's drafts within what one verification may carry, decides which the target keeps, keeps
the counters (vLLM's spec-decode metrics), and turns a proposer's failure into plain decoding for
that sequence, counted, never a wrong token."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass

import torch

from flashmemory.engine.sampling import Sampler
from flashmemory.engine.sequence import Sequence
from flashmemory.engine.speculative.proposal import Proposal, Proposer
from flashmemory.engine.speculative.step_costs import MAX_ACCEPTANCE, StepCosts
from flashmemory.engine.speculative.verify import accept

logger = logging.getLogger(__name__)


@dataclass
class SpecStats:
    """Counters since start-up (the server exports them as flashmemory:spec_decode_*_total)."""

    spec_decode_num_drafts: int = 0  # verification forwards that carried drafts
    spec_decode_draft_tokens: int = 0  # tokens proposed
    spec_decode_accepted_tokens: int = 0  # of them, kept by the target
    # tokens verifications produced (kept drafts + the target's own)
    spec_decode_emitted_tokens: int = 0
    spec_decode_fallbacks: int = 0  # sequences whose proposer failed; they went on decoding plainly
    # decode steps left plain because the measured costs said drafting would be slower
    spec_decode_paused_steps: int = 0

    @property
    def spec_decode_acceptance_rate(self) -> float:
        drafted = self.spec_decode_draft_tokens
        return self.spec_decode_accepted_tokens / drafted if drafted else 0.0

    def as_dict(self) -> dict[str, int | float]:
        return {**dataclasses.asdict(self),
                "spec_decode_acceptance_rate": self.spec_decode_acceptance_rate}


# Weight of the newest verification in a sequence's acceptance estimate (adaptive drafting).
ACCEPTANCE_WEIGHT = 0.5
# With cost_aware, every this many decode steps of a sequence goes the other way (plain where it
# drafts; drafting where it is paused and a better acceptance could pay), so the acceptance and
# the costs it rests on stay measured.
PROBE_STEPS = 16


class Speculator:
    """Drafts through `proposer`, at most `num_tokens` a step; with `adaptive`, each sequence's
    drafts shrink with its recent acceptance; with `cost_aware` too, a sequence drafts the number
    of tokens the measured step costs (`costs`) say emits tokens fastest, none where plain decoding
    is faster."""

    def __init__(self, proposer: Proposer, num_tokens: int, adaptive: bool = True,
                 cost_aware: bool = False) -> None:
        self.proposer = proposer
        self.num_tokens = num_tokens
        self.adaptive = adaptive
        self.cost_aware = adaptive and cost_aware
        self.costs = StepCosts()
        self.stats = SpecStats()
        self._plain: set[int] = set()  # sequences whose proposer failed: decoded without drafts
        self._acceptance: dict[int, float] = {}  # per sequence: recent kept / drafted (1 at first)
        self._steps: dict[int, int] = {}  # per sequence: decode steps asked about (cost_aware)

    def propose(self, seq: Sequence, sampler: Sampler, room: int) -> Proposal | None:
        """Drafts for `seq`'s next step: at most `room` (what the step may verify) and the setting;
        None to decode plainly."""
        if seq.seq_id in self._plain:
            return None
        limit = min(self.drafts_for(seq.seq_id), room)
        if limit < 1:
            return None
        started = time.perf_counter()
        try:
            proposal = self.proposer.propose(seq, limit, sampler)
        except Exception as e:  # noqa: BLE001 - drafting is an optimisation: the sequence goes on
            self.fail(seq.seq_id, e)
            return None
        if proposal is None or not proposal.tokens:
            return None
        self.costs.observe_drafting(time.perf_counter() - started, len(proposal.tokens))
        proposal.tokens = proposal.tokens[:limit]
        if proposal.probs is not None:
            proposal.probs = proposal.probs[:limit]
        return proposal

    def drafts_for(self, seq_id: int) -> int:
        """Tokens to draft for the sequence's next step (before the step's own limits); each call
        is one decode step of the sequence."""
        if not self.adaptive:
            return self.num_tokens
        acceptance = self._acceptance.get(seq_id, 1.0)
        by_acceptance = max(1, math.ceil(self.num_tokens * acceptance))
        if not self.cost_aware:
            return by_acceptance
        step = self._steps[seq_id] = self._steps.get(seq_id, 0) + 1
        if self.costs.plain_s is None:  # the first step plain, to time one; else as by acceptance
            return 0 if step == 1 else by_acceptance
        best = self.costs.best_drafts(acceptance, self.num_tokens)
        if best == 0:
            # A probe re-measures the acceptance (and makes a draft model catch up on the
            # tokens it skipped): only where a better acceptance could make drafting pay.
            at_best = self.costs.best_drafts(MAX_ACCEPTANCE, self.num_tokens)
            if at_best and step % PROBE_STEPS == 0:
                return at_best
            self.stats.spec_decode_paused_steps += 1
            return 0
        return 0 if step % PROBE_STEPS == 0 else best  # a plain step re-measures its cost

    def observe_step(self, seconds: float, rows: int) -> None:
        """One sequence's decode forward (alone in its step) of `rows` rows took `seconds`: 1, a
        plain step; more, a verification."""
        if rows == 1:
            self.costs.observe_plain(seconds)
        else:
            self.costs.observe_verification(seconds, rows)

    def verify(self, seq_id: int, proposal: Proposal, logits: torch.Tensor,
               sampler: Sampler) -> list[int]:
        """The tokens to emit (kept drafts, then the target's own); see verify.accept."""
        emitted = accept(proposal, logits, sampler)
        rate = (len(emitted) - 1) / len(proposal.tokens)
        old = self._acceptance.get(seq_id, 1.0)
        self._acceptance[seq_id] = (1 - ACCEPTANCE_WEIGHT) * old + ACCEPTANCE_WEIGHT * rate
        s = self.stats
        s.spec_decode_num_drafts += 1
        s.spec_decode_draft_tokens += len(proposal.tokens)
        s.spec_decode_accepted_tokens += len(emitted) - 1
        s.spec_decode_emitted_tokens += len(emitted)
        return emitted

    def follow(self, seq: Sequence, num_tokens: int) -> None:
        """The target prefills `seq` up to `num_tokens` this step: the proposer reads along."""
        if seq.seq_id in self._plain:
            return
        try:
            self.proposer.follow(seq, num_tokens)
        except Exception as e:  # noqa: BLE001 - as in propose
            self.fail(seq.seq_id, e)

    def settle(self, seq: Sequence) -> None:
        """After a step's tokens were emitted: the proposer forgets what it drafted past them."""
        if seq.seq_id in self._plain:
            return
        try:
            self.proposer.settle(seq)
        except Exception as e:  # noqa: BLE001 - as in propose
            self.fail(seq.seq_id, e)

    def release(self, seq_id: int) -> None:
        self._plain.discard(seq_id)
        self._acceptance.pop(seq_id, None)
        self._steps.pop(seq_id, None)
        try:
            self.proposer.release(seq_id)
        except Exception as e:  # noqa: BLE001 - freeing a draft's KV must not fail the target's
            logger.error("releasing the draft state of sequence %d failed: %s", seq_id, e,
                         exc_info=True)

    def close(self) -> None:
        """Release what the proposer holds (a draft model's KV levels)."""
        self.proposer.close()

    def fail(self, seq_id: int, error: Exception) -> None:
        """The sequence's drafting failed: it decodes plainly from here, counted."""
        logger.error("the %s proposer failed for sequence %d (%s: %s); it decodes without drafts "
                     "from here", self.proposer.name, seq_id, type(error).__name__, error,
                     exc_info=True)
        self.stats.spec_decode_fallbacks += 1
        self._plain.add(seq_id)
        try:
            self.proposer.release(seq_id)
        except Exception:  # noqa: BLE001 - already failing; what it held is lost with it
            logger.debug("release after failure failed", exc_info=True)
