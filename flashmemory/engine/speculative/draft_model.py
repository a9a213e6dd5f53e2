"""DraftModelProposer: a smaller model drafts by decoding ahead, with the target's tokenizer or,
through a token bridge, with its own.

It keeps its own KV cache (its own levels, prefix cache and budget) for the same sequences. Each
step it first catches up on the sequence's tokens it has not read (the prompt, in chunks of at most
`chunk_tokens` a step, proposing nothing until done; then the tokens the last verification kept),
then decodes its drafts one at a time. Across tokenizers it reads the target's tokens in its own
ids (`BridgeStream`: the finished words for good, the word still open provisionally) and hands its
drafts back in the target's ids. Whatever it read that the target did not keep, or that a longer
word reads differently, is forgotten (`KVCache.truncate`), so everything provisional stays in its
filling block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashmemory.engine.sampling import Sampler
from flashmemory.engine.sequence import Sequence
from flashmemory.engine.speculative.proposal import Proposal
from flashmemory.kvcache.interface import ForwardBatch, KVCache
from flashmemory.model.token_bridge import BridgeStream, TokenBridge


@dataclass
class DraftBridges:
    """The two directions between a draft's vocabulary and the target's."""

    to_draft: TokenBridge  # the target's tokens, as the draft reads them
    to_target: TokenBridge  # the draft's tokens, as the target verifies them


@dataclass
class _DraftState:
    """Per sequence: the draft ids whose KV the draft holds, the target's tokens in draft ids,
    and how many of those are the prompt's (known once the stream has read all of it)."""

    read: list[int]
    stream: BridgeStream
    prompt_len: int | None = None


class DraftModelProposer:
    """Drafts with `model` over `cache` (room for `max_tokens` draft ids a sequence); sequence ids
    are the target's; `bridges` when the draft's vocabulary is another one."""

    name = "draft"

    def __init__(self, model: torch.nn.Module, cache: KVCache, device: torch.device,
                 chunk_tokens: int, max_tokens: int, bridges: DraftBridges | None = None) -> None:
        self.model = model
        self.cache = cache
        self.device = device
        self.chunk_tokens = chunk_tokens
        self.max_tokens = max_tokens
        self.bridges = bridges
        self._states: dict[int, _DraftState] = {}

    def follow(self, seq: Sequence, num_tokens: int) -> None:
        """One chunk of the prompt a step at most: a draft behind the target (the target reused a
        prefix the draft's cache lacks) catches up over several steps, drafting nothing."""
        state = self._state(seq)
        self._read_target(state, seq, min(num_tokens, len(seq.prompt_ids)))
        stable = state.stream.committed
        end = min(len(stable), len(state.read) + self.chunk_tokens)
        if len(state.read) < end:
            self._forward(seq.seq_id, state.read, stable[len(state.read) : end],
                          want_logits=False)

    def _state(self, seq: Sequence) -> _DraftState:
        """What the draft holds of `seq` (a new sequence starts with its cached prefix)."""
        state = self._states.get(seq.seq_id)
        if state is None:
            to_draft = self.bridges.to_draft if self.bridges else None
            prompt = BridgeStream(to_draft)
            prompt.extend(seq.prompt_ids)
            self.cache.add_sequence(seq.seq_id)
            state = self._states[seq.seq_id] = _DraftState([], BridgeStream(to_draft))
            reused = self.cache.reuse_prefix(seq.seq_id, prompt.committed)
            state.read.extend(prompt.committed[:reused])
        return state

    def _read_target(self, state: _DraftState, seq: Sequence, num_tokens: int) -> None:
        """The stream reads the target's tokens up to `num_tokens`."""
        stream, prompt = state.stream, len(seq.prompt_ids)
        if stream.source_len < prompt:
            stream.extend(seq.token_ids(stream.source_len, min(num_tokens, prompt)))
        if stream.source_len == prompt and state.prompt_len is None:
            state.prompt_len = len(stream.committed)
        if stream.source_len < num_tokens:
            stream.extend(seq.token_ids(stream.source_len, num_tokens))

    def propose(self, seq: Sequence, max_tokens: int, sampler: Sampler) -> Proposal | None:
        state = self._state(seq)
        self._read_target(state, seq, seq.num_tokens)
        self._forget_past(seq.seq_id, state)
        if len(state.stream.ids) + max_tokens > self.max_tokens:
            return None  # the draft's context is full: the target goes on alone
        logits, room = self._catch_up(seq, state)
        if logits is None:
            return None
        # Each draft but the last is read too: all of them must be forgettable.
        max_tokens = min(max_tokens, room)
        drafts, probs = [], []
        while True:
            token, dist = _draw(logits[-1], sampler)
            drafts.append(token)
            probs.append(dist)
            if len(drafts) == max_tokens:
                break
            logits = self._forward(seq.seq_id, state.read, [token])
        if self.bridges is None:
            stacked = None if sampler.params.is_greedy else torch.stack(probs)
            return Proposal(drafts, stacked)
        # In the target's ids the draft's distributions no longer apply: each token is offered as
        # certain, which rejection sampling keeps exact (verify.accept).
        tokens = self.bridges.to_target.translate(drafts, stop_at_unnamed=True).ids
        return Proposal(tokens) if tokens else None

    def _catch_up(self, seq: Sequence, state: _DraftState) -> tuple[torch.Tensor | None, int]:
        """Read the tokens not read yet: the prompt as the target's prefill does (a chunk a step
        while more than one is left: nothing to draft yet), the generated ones as decode steps (so
        a draft of the target's own weights computes the target's KV), then the open word
        provisionally. The logits of the last token read (None: nothing to draft from this step)
        and how many drafts may follow it in the filling block."""
        read, seq_id = state.read, seq.seq_id
        assert state.prompt_len is not None, "propose runs once the prompt is prefilled"
        prompt_left = state.prompt_len - len(read)
        if prompt_left > self.chunk_tokens:
            self._forward(seq_id, read, state.stream.committed[len(read) : len(read)
                                                                + self.chunk_tokens],
                          want_logits=False)
            return None, 0
        if prompt_left > 0:
            self._forward(seq_id, read, state.stream.committed[len(read) : state.prompt_len],
                          want_logits=False)
        logits = None
        stable = state.stream.committed
        while len(read) < len(stable):  # within one block at a time, as decode steps read them
            rows = self.cache.max_decode_rows(seq_id)
            logits = self._forward(seq_id, read, stable[len(read) : len(read) + rows],
                                   as_decode=True)
        rows = self.cache.max_decode_rows(seq_id)
        provisional = state.stream.ids[len(read) :]  # the open word, after what was kept of it
        if len(provisional) >= rows:
            return None, 0  # the word and a draft would leave the filling block: next step
        if provisional:
            logits = self._forward(seq_id, read, provisional, as_decode=True)
        return logits, rows - len(provisional)

    def settle(self, seq: Sequence) -> None:
        state = self._states.get(seq.seq_id)
        if state is None:
            return
        self._read_target(state, seq, seq.num_tokens)
        self._forget_past(seq.seq_id, state)

    def _forget_past(self, seq_id: int, state: _DraftState) -> None:
        """Forget what the draft read past the longest prefix it shares with the target's tokens
        (rejected drafts, the old reading of a word that went on)."""
        read, wanted = state.read, state.stream.ids
        same = 0
        limit = min(len(read), len(wanted))
        while same < limit and read[same] == wanted[same]:
            same += 1
        if same < len(read):
            self.cache.truncate(seq_id, same)
            del read[same:]

    def release(self, seq_id: int) -> None:
        if self._states.pop(seq_id, None) is not None:
            self.cache.free_sequence(seq_id)

    def close(self) -> None:
        self._states.clear()
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
