"""Prompt lookup (n-gram drafting): the tokens that followed the most recent earlier occurrence of
the sequence's newest n-gram, longest n first (llama.cpp's lookup decoding, vLLM's `ngram`). No
second model: it wins where the answer quotes the prompt (code edits, extraction, summaries that
copy phrases) and costs almost nothing where it does not."""

from __future__ import annotations

from dataclasses import dataclass, field

from flashmemory.engine.sampling import Sampler
from flashmemory.engine.sequence import Sequence
from flashmemory.engine.speculative.proposal import Proposal


@dataclass
class _Index:
    """One sequence's n-grams: for each length n, each n-gram -> the position just after its most
    recent occurrence among the tokens indexed so far."""

    indexed: int = 0  # n-grams ending before this position are in `after`
    after: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)


class NgramProposer:
    """Drafts by lookup in the sequence's own tokens, indexed incrementally (O(new tokens) a
    step)."""

    name = "ngram"

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram lengths must satisfy 1 <= min_n <= max_n, got {min_n}, "
                             f"{max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._indexes: dict[int, _Index] = {}

    def propose(self, seq: Sequence, max_tokens: int, sampler: Sampler) -> Proposal | None:
        tokens = seq.token_ids(0, seq.num_tokens)
        index = self._indexes.setdefault(seq.seq_id, _Index(after={n: {} for n in self._lengths()}))
        last = len(tokens) - 1
        # Index every n-gram that ends before the newest token, then look the newest ones up.
        for end in range(index.indexed, last):
            for n in self._lengths():
                if end + 1 >= n:
                    index.after[n][tuple(tokens[end + 1 - n : end + 1])] = end + 1
        index.indexed = max(index.indexed, last)
        for n in reversed(self._lengths()):
            if len(tokens) < n:
                continue
            start = index.after[n].get(tuple(tokens[len(tokens) - n :]))
            if start is not None:
                return Proposal(tokens[start : start + max_tokens])
        return None

    def follow(self, seq: Sequence, num_tokens: int) -> None:
        """The index is built when a draft is asked for."""

    def settle(self, seq: Sequence) -> None:
        """Nothing drafted is kept: the index holds the sequence's own tokens only."""

    def release(self, seq_id: int) -> None:
        self._indexes.pop(seq_id, None)

    def close(self) -> None:
        self._indexes.clear()

    def _lengths(self) -> range:
        return range(self.min_n, self.max_n + 1)
