"""Prompt lookup: the tokens after the newest n-gram's last earlier occurrence, longest n first."""

from __future__ import annotations

import torch

from flashmemory.engine.sampling import Sampler, SamplingParams
from flashmemory.engine.sequence import Sequence
from flashmemory.engine.speculative.ngram import NgramProposer

GREEDY = Sampler(SamplingParams(), torch.device("cpu"))


def _seq(tokens: list[int], prompt: int | None = None) -> Sequence:
    prompt = len(tokens) if prompt is None else prompt
    seq = Sequence(0, tokens[:prompt], max_tokens=100)
    seq.output_ids = tokens[prompt:]
    return seq


def test_the_longest_matching_ngram_wins_and_its_continuation_is_proposed():
    # "5 6 7" occurs once before (followed by 8 9); "6 7" also occurs followed by 1.
    tokens = [6, 7, 1, 5, 6, 7, 8, 9, 4, 5, 6, 7]
    proposal = NgramProposer(1, 3).propose(_seq(tokens), 2, GREEDY)
    assert proposal.tokens == [8, 9] and proposal.probs is None


def test_the_most_recent_occurrence_is_used():
    tokens = [3, 4, 10, 3, 4, 11, 3, 4]
    assert NgramProposer(2, 2).propose(_seq(tokens), 1, GREEDY).tokens == [11]


def test_no_match_proposes_nothing_and_shorter_ngrams_than_min_are_not_tried():
    assert NgramProposer(2, 3).propose(_seq([1, 2, 3, 4, 5, 3]), 4, GREEDY) is None
    assert NgramProposer(1, 3).propose(_seq([1, 2, 3, 4, 5, 3]), 4, GREEDY).tokens == [4, 5, 3]


def test_the_index_grows_with_the_sequence_and_reads_the_output_too():
    proposer = NgramProposer(2, 2)
    seq = _seq([1, 2, 3, 9, 9], prompt=3)
    assert proposer.propose(seq, 3, GREEDY) is None
    seq.output_ids += [1, 2]  # the answer starts quoting the prompt
    assert proposer.propose(seq, 3, GREEDY).tokens == [3, 9, 9]
    proposer.release(0)
    assert proposer.propose(seq, 3, GREEDY).tokens == [3, 9, 9]  # rebuilt from scratch alike
