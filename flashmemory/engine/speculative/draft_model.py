"""DraftModelProposer: a smaller model with the target's tokenizer drafts by decoding ahead.

It keeps its own KV cache (its own levels, prefix cache and budget) for the same sequences. Each
step it first catches up on the sequence's tokens it has not read (the prompt, in chunks of at most
`chunk_tokens` a step, proposing nothing until done; then the tokens the last verification kept),
then decodes its drafts one at a time. The drafts it read but the target did not keep are
forgotten (`KVCache.truncate`), so it never drafts past more than its cache can forget: to the end
of its filling block.
"""

from __future__ import annotations

import torch

from flashmemory.engine.sampling import Sampler
from flashmemory.engine.sequence import Sequence
from flashmemory.engine.speculative.proposal import Proposal
from flashmemory.kvcache.interface import ForwardBatch, KVCache


class DraftModelProposer:
    """Drafts with `model` over `cache`; sequence ids are the target's."""

    name = "draft"

    def __init__(self, model: torch.nn.Module, cache: KVCache, device: torch.device,
                 chunk_tokens: int) -> None:
        self.model = model
        self.cache = cache
        self.device = device
        self.chunk_tokens = chunk_tokens
        self._read: dict[int, list[int]] = {}  # per sequence: the tokens whose KV the draft holds

    def follow(self, seq: Sequence, num_tokens: int) -> None:
        """One chunk of the prompt a step at most: a draft behind the target (the target reused a
        prefix the draft's cache lacks) catches up over several steps, drafting nothing."""
        read = self._state(seq)
        end = min(num_tokens, len(seq.prompt_ids), len(read) + self.chunk_tokens)
        if len(read) < end:
            self._forward(seq.seq_id, read, seq.prompt_ids[len(read) : end], want_logits=False)

    def _state(self, seq: Sequence) -> list[int]:
        """The tokens the draft holds of `seq` (a new sequence starts with its cached prefix)."""
        read = self._read.get(seq.seq_id)
        if read is None:
            self.cache.add_sequence(seq.seq_id)
            read = self._read[seq.seq_id] = []
            reused = self.cache.reuse_prefix(seq.seq_id, seq.prompt_ids)
            read.extend(seq.prompt_ids[:reused])
        return read

    def propose(self, seq: Sequence, max_tokens: int, sampler: Sampler) -> Proposal | None:
        tokens = seq.token_ids(0, seq.num_tokens)
        read = self._state(seq)
        if tokens[: len(read)] != read:
            raise RuntimeError(f"draft of sequence {seq.seq_id}: its tokens changed under it")
        logits = self._catch_up(seq, read, tokens)
        if logits is None:
            return None
        # Each draft but the last is read too: all of them must be forgettable.
        max_tokens = min(max_tokens, self.cache.max_decode_rows(seq.seq_id))
        drafts, probs = [], []
        while True:
            token, dist = _draw(logits[-1], sampler)
            drafts.append(token)
            probs.append(dist)
            if len(drafts) == max_tokens:
                break
            logits = self._forward(seq.seq_id, read, [token])
        stacked = None if sampler.params.is_greedy else torch.stack(probs)
        return Proposal(drafts, stacked)

    def _catch_up(self, seq: Sequence, read: list[int], tokens: list[int]) -> torch.Tensor | None:
        """Read the tokens not read yet: the prompt as the target's prefill does (a chunk a step
        while more than one is left: None, nothing to draft yet), the generated ones as decode
        steps (so a draft of the target's own weights computes the target's KV); the logits of
        the last token."""
        prompt_left = len(seq.prompt_ids) - len(read)
        if prompt_left > self.chunk_tokens:
            self._forward(seq.seq_id, read, tokens[len(read) : len(read) + self.chunk_tokens],
                          want_logits=False)
            return None
        if prompt_left > 0:
            self._forward(seq.seq_id, read, seq.prompt_ids[len(read) :], want_logits=False)
        while True:  # within one block at a time, as the target's decode steps read them
            missing = tokens[len(read) :]
            rows = self.cache.max_decode_rows(seq.seq_id)
            logits = self._forward(seq.seq_id, read, missing[:rows], as_decode=True)
            if len(missing) <= rows:
                return logits

    def settle(self, seq: Sequence) -> None:
        read = self._read.get(seq.seq_id)
        if read is None:
            return
        tokens = seq.token_ids(0, min(seq.num_tokens, len(read)))
        same = 0
        while same < len(tokens) and tokens[same] == read[same]:
            same += 1
        if same < len(read):
            self.cache.truncate(seq.seq_id, same)
            del read[same:]

    def release(self, seq_id: int) -> None:
        if self._read.pop(seq_id, None) is not None:
            self.cache.free_sequence(seq_id)

    def close(self) -> None:
        self._read.clear()
        self.cache.close()

    def _forward(self, seq_id: int, read: list[int], tokens: list[int], want_logits: bool = True,
                 as_decode: bool = False) -> torch.Tensor:
        """Read `tokens` after `read` (committed); the logits [1, vocab] of the last one."""
        batch = ForwardBatch.build([(seq_id, len(read), len(tokens), tokens)], self.device,
                                   as_decode={seq_id} if as_decode else ())
        rows = [len(tokens) - 1] if want_logits else []
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        try:
            wanted = torch.tensor(rows, dtype=torch.long, device=self.device)
            logits = self.model(ids, self.cache, batch, logits_indices=wanted)
        except Exception:
            self.cache.rollback(batch)
            raise
        self.cache.commit(batch)
        read.extend(tokens)
        return logits


def _draw(logits: torch.Tensor, sampler: Sampler) -> tuple[int, torch.Tensor | None]:
    """The draft's next token as the request draws (its argmax when greedy), and its
    distribution."""
    if sampler.params.is_greedy:
        return int(torch.argmax(logits)), None
    dist = sampler.distribution(logits)
    return sampler.draw(dist), dist
