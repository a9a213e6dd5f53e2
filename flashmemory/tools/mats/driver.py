"""CacheDriver: drives one TieredKVCache the way the engine core does — add (with a pinned span), batched forwards
of prefill chunks and decode steps, commit per sequence, demote / promote, free, abort — keeping the shadow of
every key and value written and checking every attention output.

Attention is checked where an exact answer exists: with every block read at full precision ("dense": FP16 levels,
exact selection) the output must equal dense attention over the shadow; with quantized levels and every block read
("levels": exact selection, or any prefill chunk, which never selects) it must equal dense attention over what the
levels hold (read back, each block from the copy the read path uses); a decode step that selects blocks is only
checked to be finite. Failures are contained as the engine contains them: the culprit is recomputed (a damaged
cold block) or failed (a full level), and counted; anything else is an error.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from flashmemory.errors import CapacityError, ColdBlockError, ColdZoneFullError, ColdZoneWriteError
from flashmemory.kvcache.interface import ForwardBatch
from flashmemory.kvcache.manager.blocks import BlockEntry, Level
from flashmemory.kvcache.tiered import TieredKVCache
from flashmemory.tools.mats.checker import ShadowChecker
from flashmemory.tools.mats.reference import dense_attention
from flashmemory.tools.mats.report import ErrorLog
from flashmemory.tools.mats.shadow import Geometry, ShadowSequence, Tokens

COLD_ZONE_FAULTS = (ColdBlockError, ColdZoneFullError, ColdZoneWriteError)  # what a faulty disk raises
REPAIRABLE = (ColdBlockError, ColdZoneWriteError)  # what the engine repairs by recomputing the sequence (once)
RECOMPUTE_CHUNK_BLOCKS = 4  # a recomputed sequence is prefilled again in chunks of this many blocks


@dataclass
class LiveSequence:
    """A sequence the driver keeps alive in the cache."""

    seq_id: int
    shadow: ShadowSequence  # every token ever written for it (a recompute writes them again)
    pinned_span: tuple[int, int] | None = None
    num_cached: int = 0  # tokens the cache holds (less than the shadow's while it is being recomputed)
    parked: bool = False  # demoted: not run until promoted
    num_recomputes: int = 0

    @property
    def full(self) -> bool:
        return self.shadow.num_tokens >= self.shadow.max_tokens


class CacheDriver:
    """Owns the live sequences and their shadows; runs them through one cache and counts what happened."""

    def __init__(self, cache: TieredKVCache, geometry: Geometry, generator: torch.Generator, max_tokens: int,
                 errors: ErrorLog, checker: ShadowChecker, counters: Counter[str], attention_tolerance: float,
                 on_fault: Callable[[Exception], None] | None = None,
                 quiet: Callable[[], AbstractContextManager] | None = None) -> None:
        self.cache = cache
        self.geometry = geometry
        self.generator = generator
        self.max_tokens = max_tokens
        self.errors = errors
        self.checker = checker
        self.counters = counters
        self.tolerance = attention_tolerance
        self.on_fault = on_fault or (lambda error: None)  # told of every contained cold-zone failure
        self.quiet = quiet or contextlib.nullcontext  # the reference's own reads run under it (no injected faults)
        # Forwards run on the cache's device (mats/device.py: the engine's); the shadow and the float64
        # references stay on the CPU, and what the cache returns is brought there to be checked.
        self.device = cache.cfg.device
        self.live: dict[int, LiveSequence] = {}
        self._next_id = 0
        self.worst_attention_error = 0.0

    # ---- lifecycle --------------------------------------------------------------------------------------------

    def add(self, pinned_span: tuple[int, int] | None = None) -> int:
        seq_id = self._next_id
        self._next_id += 1
        shadow = ShadowSequence(self.geometry, self.max_tokens, self.generator)
        self.live[seq_id] = LiveSequence(seq_id, shadow, pinned_span)
        self.checker.shadows[seq_id] = shadow
        self._admit(self.live[seq_id])
        self.counters["sequences_added"] += 1
        return seq_id

    def _admit(self, seq: LiveSequence) -> None:
        self.cache.add_sequence(seq.seq_id)
        if seq.pinned_span is not None:
            self.cache.pin_span(seq.seq_id, *seq.pinned_span)  # as the engine does: right after admission

    def free(self, seq_id: int, reason: str = "sequences_freed") -> None:
        self.cache.free_sequence(seq_id)
        self.live.pop(seq_id, None)
        self.checker.shadows.pop(seq_id, None)
        self.counters[reason] += 1

    def free_all(self) -> None:
        for seq_id in list(self.live):
            self.free(seq_id)

    def demote(self, seq_id: int) -> None:
        self.counters["blocks_demoted"] += self.cache.demote_sequence(seq_id)
        self.live[seq_id].parked = True

    def promote(self, seq_id: int) -> None:
        self.counters["blocks_promoted"] += self.cache.promote_sequence(seq_id)
        self.live[seq_id].parked = False

    def abort(self, seq_id: int, num_tokens: int) -> None:
        """A forward that stops part-way (a client gone, a failure): some layers attend, then rollback and free."""
        seq = self.live[seq_id]
        tokens = seq.shadow.new_tokens(num_tokens, self.generator)
        batch = ForwardBatch.build([(seq_id, seq.num_cached, num_tokens)], self.device)
        layers = int(torch.randint(0, self.geometry.num_layers, (1,), generator=self.generator))
        try:
            for layer in range(layers):
                self.cache.attend(layer, batch, *self._on_device(tokens.q[layer], tokens.k[layer],
                                                                 tokens.v[layer]))
        finally:
            self.cache.rollback(batch)
        self.free(seq_id, "sequences_aborted")

    # ---- forwards ---------------------------------------------------------------------------------------------

    def forward(self, work: list[tuple[int, int]]) -> None:
        """One batched forward: (seq_id, new tokens) per sequence, then a commit per sequence (as the engine does)."""
        entries, tokens, references = [], {}, {}
        for seq_id, n in work:
            seq = self.live[seq_id]
            start = seq.num_cached
            replay = start + n <= seq.shadow.num_tokens
            tokens[seq_id] = (seq.shadow.replay(start, start + n, self.generator) if replay
                              else seq.shadow.new_tokens(n, self.generator))
            entries.append((seq_id, start, n))
        batch = ForwardBatch.build(entries, self.device)
        try:
            with self.quiet():
                for seq_id, _ in work:
                    references[seq_id] = self._reference(self.live[seq_id], tokens[seq_id])
            outputs = self._attend_all(batch, work, tokens)
        except Exception as error:  # noqa: BLE001 - contained as the engine contains it
            self.cache.rollback(batch)
            culprit = getattr(error, "seq_id", None)
            self.contain(error, [s for s, _ in work if s == culprit] or [s for s, _ in work])
            return
        for i, (seq_id, n) in enumerate(work):
            self._check_output(seq_id, outputs[:, batch.slices[i].token_start : batch.slices[i].token_end],
                               references[seq_id])
            try:
                self.cache.commit(batch.only(i))
            except Exception as error:  # noqa: BLE001
                self._committed(seq_id, tokens[seq_id])  # the tokens are in (blocks written) before placement runs
                self.contain(error, [seq_id])
                continue
            self._committed(seq_id, tokens[seq_id])
        self.counters["forwards"] += 1
        self.counters["tokens"] += sum(n for _, n in work)

    def _attend_all(self, batch: ForwardBatch, work: list[tuple[int, int]], tokens: dict[int, Tokens]) -> torch.Tensor:
        outs = []
        for layer in range(self.geometry.num_layers):
            q = torch.cat([tokens[s].q[layer] for s, _ in work])  # [T, heads, D]
            k = torch.cat([tokens[s].k[layer] for s, _ in work])  # [T, kv_heads, D]
            v = torch.cat([tokens[s].v[layer] for s, _ in work])
            outs.append(self.cache.attend(layer, batch, *self._on_device(q, k, v)).cpu())
        return torch.stack(outs)  # [layers, T, heads, D]

    def _on_device(self, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of a forward as the model hands them to the cache: float32, on the compute device."""
        return q.to(self.device), k.to(self.device, torch.float32), v.to(self.device, torch.float32)

    def _committed(self, seq_id: int, tokens: Tokens) -> None:
        seq = self.live.get(seq_id)
        if seq is None or self.cache.num_tokens(seq_id) == seq.num_cached:
            return
        if seq.num_cached == seq.shadow.num_tokens:
            seq.shadow.append(tokens)
        seq.num_cached += tokens.num_tokens

    def recompute(self, seq_id: int) -> None:
        """Free the sequence's KV and prefill every token it had again (the engine's repair of a damaged block)."""
        seq = self.live[seq_id]
        self.cache.free_sequence(seq_id)
        seq.num_cached, seq.parked = 0, False
        seq.num_recomputes += 1
        self._admit(seq)
        self.counters["sequences_recomputed"] += 1
        chunk = RECOMPUTE_CHUNK_BLOCKS * self.geometry.block_size
        while seq_id in self.live and seq.num_cached < seq.shadow.num_tokens:
            before = seq.num_cached
            self.forward([(seq_id, min(chunk, seq.shadow.num_tokens - seq.num_cached))])
            if seq_id in self.live and seq.num_cached == before:
                break  # failed again and was dealt with

    def contain(self, error: Exception, culprits: list[int]) -> None:
        """Deal with a failed operation as the engine would: recompute or fail each culprit (always: a sequence
        whose commit failed part-way holds blocks past its tokens and must not be used again)."""
        if isinstance(error, COLD_ZONE_FAULTS):
            try:
                self.on_fault(error)
            except Exception as e:  # noqa: BLE001 - a finding, and the culprits must still be dealt with
                self.errors.add("exception", f"checking after {type(error).__name__}: {type(e).__name__}: {e}")
        for seq_id in culprits:
            seq = self.live.get(seq_id)
            if seq is None:
                continue
            if isinstance(error, REPAIRABLE) and seq.num_recomputes == 0:
                self.recompute(seq_id)
            elif isinstance(error, REPAIRABLE):
                self.free(seq_id, "sequences_failed_faulty")  # faulted again after a recompute
            elif isinstance(error, CapacityError):  # a full level: the engine fails the sequence with the reason
                self.free(seq_id, "sequences_failed_full")
            else:
                self.errors.add("exception", f"sequence {seq_id}: {type(error).__name__}: {error}")
                self.free(seq_id, "sequences_failed_error")

    # ---- checks -----------------------------------------------------------------------------------------------

    def _mode(self, num_tokens: int) -> str:
        exact = self.cache.cfg.selection == "exact" or num_tokens > 1  # prefill chunks never select
        if not exact:
            return "finite"
        return "dense" if all(c.bits == 16 for c in self.cache.codecs.values()) else "levels"

    def _reference(self, seq: LiveSequence, tokens: Tokens) -> torch.Tensor | None:
        """Dense attention [layers, n, heads, D] the forward must give, or None where no exact answer exists."""
        mode = self._mode(tokens.num_tokens)
        if mode == "finite":
            return None
        start = seq.num_cached
        k, v = seq.shadow.upto(start)  # [layers, start, kv_heads, D]
        if mode == "levels":
            k, v = self._stored_kv(seq, k.double(), v.double(), decoding=tokens.num_tokens == 1)
        k = torch.cat((k.double(), tokens.k.double()), dim=1)
        v = torch.cat((v.double(), tokens.v.double()), dim=1)
        return torch.stack([dense_attention(tokens.q[layer], k[layer], v[layer], start)
                            for layer in range(self.geometry.num_layers)])

    def _stored_kv(self, seq: LiveSequence, k: torch.Tensor, v: torch.Tensor,
                   decoding: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The shadow's K/V with each full block the read path reads from a level replaced by
        what the copy it uses holds, decoded."""
        bs = self.geometry.block_size
        blocks = self.cache.blocks.tables[seq.seq_id].blocks
        # NOTE: the sink and the newest full blocks (recent_fp16_tokens) are attended from the
        # sequence's FP16 row, not read from a level: there the forward sees the shadow's values.
        row = self.cache.seqs[seq.seq_id]
        first, end = row.num_sink // bs, len(blocks) - row.num_recent // bs
        by_level: dict[Level, list[int]] = {}
        for index in range(first, end):
            by_level.setdefault(self._copy_read(blocks[index], decoding), []).append(index)
        for level, indices in by_level.items():
            storage = self.cache.levels[level]
            table = self.cache.blocks.tables[seq.seq_id].blocks
            slots = [table[i].slots[level] for i in indices]
            for layer in range(self.geometry.num_layers):
                parts = storage.read_layer(slots, layer)  # [kv_heads, n, ...]
                kv = self.cache.codecs[level].decode(parts, torch.float64).cpu()  # [2, kv_heads, n, bs, D]
                for j, index in enumerate(indices):
                    self.checker.check(level, seq.seq_id, index, {n: t[:, j] for n, t in parts.items()}, layer,
                                       "reference read")
                    k[layer, index * bs : (index + 1) * bs] = kv[0, :, j].transpose(0, 1)
                    v[layer, index * bs : (index + 1) * bs] = kv[1, :, j].transpose(0, 1)
        return k, v

    def _copy_read(self, block: BlockEntry, decoding: bool) -> Level:
        """The copy attention reads: a decode step the fastest; a prefill chunk the fastest FP16 copy, if any."""
        if not decoding:
            exact = [level for level in sorted(block.slots) if self.cache.codecs[level].bits == 16]
            if exact:
                return exact[0]
        return block.primary

    def _check_output(self, seq_id: int, out: torch.Tensor, reference: torch.Tensor | None) -> None:
        self.counters["attention_checks"] += 1
        if not bool(torch.isfinite(out).all()):
            self.errors.add("attention", f"sequence {seq_id}: the attention output is not finite")
            return
        if reference is None:
            return
        self.counters["attention_checks_exact"] += 1
        error = float((out.double() - reference).abs().max())
        self.worst_attention_error = max(self.worst_attention_error, error)
        if error > self.tolerance:
            self.errors.add("attention", f"sequence {seq_id}: attention differs from the reference by {error:.3g} "
                                         f"(> {self.tolerance:g}) at {self.live[seq_id].num_cached} cached tokens")
