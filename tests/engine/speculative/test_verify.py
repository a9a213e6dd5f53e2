"""Which drafts the target keeps: greedy keeps its own argmax path; sampling (rejection sampling)
emits tokens distributed exactly as the target's sampler draws them, whatever the draft."""

from __future__ import annotations

import pytest
import torch

from flashmemory.engine.sampling import Sampler, SamplingParams
from flashmemory.engine.speculative.proposal import Proposal
from flashmemory.engine.speculative.verify import accept


def _logits(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows)


def test_greedy_keeps_the_drafts_up_to_the_first_disagreement_then_the_targets_token():
    greedy = Sampler(SamplingParams(), torch.device("cpu"))
    logits = torch.eye(6)[[2, 3, 5, 1]] * 5  # the target's argmax after each prefix: 2, 3, 5, 1
    assert accept(Proposal([2, 3, 4]), logits, greedy) == [2, 3, 5]
    assert accept(Proposal([2, 3, 5]), logits, greedy) == [2, 3, 5, 1]  # all kept, one more
    assert accept(Proposal([0, 3, 5]), logits, greedy) == [2]


def _draws(q: torch.Tensor | None, token: int, logits: torch.Tensor, temperature: float,
           n: int) -> torch.Tensor:
    """The first emitted token of n verifications of one draft: `token` (certain) when q is None,
    else a token drawn from q each time, as a draft model draws it."""
    sampler = Sampler(SamplingParams(temperature=temperature, seed=7), torch.device("cpu"))
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(n):
        proposal = Proposal([token]) if q is None else Proposal(
            [int(torch.multinomial(q, 1, generator=g))], q[None, :])
        out.append(accept(proposal, logits, sampler)[0])
    return torch.tensor(out)


@pytest.mark.parametrize("draft", ["certain", "sampled"])
def test_sampling_emits_the_targets_distribution_whatever_the_draft(draft):
    vocab, n = 6, 20000
    g = torch.Generator().manual_seed(3)
    target = torch.randn(2, vocab, generator=g) * 1.5
    p = torch.softmax(target[0] / 0.8, dim=-1)
    if draft == "certain":  # prompt lookup: a token without a distribution
        q, token = None, int(torch.argmin(p))  # the draft the target likes least
    else:  # a draft model that prefers other tokens than the target
        q, token = torch.softmax(torch.randn(vocab, generator=g) * 2, dim=-1), -1
    counts = torch.bincount(_draws(q, token, target, 0.8, n), minlength=vocab).float()
    # Chi-square against the target's own distribution: 5 degrees of freedom, p = 0.001 at 20.5.
    chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
    assert chi2 < 20.5, (counts / n, p)


def test_a_draft_the_target_agrees_with_entirely_is_always_kept():
    target = torch.randn(3, 5)
    sampler = Sampler(SamplingParams(temperature=1.0, seed=1), torch.device("cpu"))
    q = torch.stack([sampler.distribution(target[i]) for i in range(2)])
    for _ in range(50):
        emitted = accept(Proposal([1, 4], q), target, sampler)
        assert emitted[:2] == [1, 4] and len(emitted) == 3  # p == q: min(1, p / q) = 1


def test_adaptive_drafting_shrinks_with_the_acceptance_and_a_fixed_k_does_not():
    from flashmemory.engine.speculative.ngram import NgramProposer
    from flashmemory.engine.speculative.speculator import Speculator

    greedy = Sampler(SamplingParams(), torch.device("cpu"))
    logits = torch.eye(6)[[2, 3, 5, 1, 0]] * 5
    adaptive, fixed = Speculator(NgramProposer(1, 2), 4), Speculator(NgramProposer(1, 2), 4, False)
    for spec in (adaptive, fixed):
        assert spec.drafts_for(7) == 4
        for _ in range(3):  # nothing kept, three times
            spec.verify(7, Proposal([0, 0, 0, 0]), logits, greedy)
    assert fixed.drafts_for(7) == 4 and adaptive.drafts_for(7) == 1
    adaptive.verify(7, Proposal([2, 3, 5, 1]), logits, greedy)  # all kept: it grows again
    assert adaptive.drafts_for(7) == 3
    adaptive.release(7)
    assert adaptive.drafts_for(7) == 4
