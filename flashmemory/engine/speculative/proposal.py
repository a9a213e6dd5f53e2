"""Proposal and Proposer: what a drafter offers the target for one decode step, and the protocol
every drafter implements (prompt lookup, a draft model)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from flashmemory.engine.sampling import Sampler
from flashmemory.engine.sequence import Sequence


@dataclass
class Proposal:
    """Draft tokens that would follow a sequence's tokens, and how likely the drafter found them."""

    tokens: list[int]
    # [len(tokens), vocab]: the distribution each token was drawn from (a sampling request's draft
    # model); None = each token was certain (greedy drafting, prompt lookup)
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    """Drafts tokens for sequences; keeps whatever state it needs per sequence id."""

    name: str

    def propose(self, seq: Sequence, max_tokens: int, sampler: Sampler) -> Proposal | None:
        """At most `max_tokens` (>= 1) tokens that may follow all of `seq`'s tokens, drawn as
        `sampler` draws; None when there is nothing to offer this step."""

    def follow(self, seq: Sequence, num_tokens: int) -> None:
        """The target is prefilling `seq`'s first `num_tokens` tokens this step: read along (a
        draft model prefills its own KV of the prompt then, not at the first decode step)."""

    def settle(self, seq: Sequence) -> None:
        """The verification is over: `seq` holds its final tokens; forget any drafted past them."""

    def release(self, seq_id: int) -> None:
        """The sequence is gone (finished, failed, preempted): drop what is kept for it."""

    def close(self) -> None:
        """The engine is closing: release everything (a draft model's KV levels)."""
