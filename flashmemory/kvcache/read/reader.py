"""BlockReader: the read path of the tiered cache — plans a forward's reads per level, makes the query-aware choice
among L1 / L2 blocks at decode steps (telling the choice observers), and gathers the chosen blocks decoded.

Its collaborators come in through the constructor: the block tables, the storage levels, their codecs and the
observers. Read-ahead layers (an L2 prefetcher, an L1 device staging area) plug in as sources for one level
(`use_read_through`, `use_per_head_source`), so the reader never knows which subsystem sits behind a level.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import Protocol

import torch

from flashmemory.errors import serving_sequence
from flashmemory.kvcache.config import TieredCacheConfig
from flashmemory.kvcache.levels.protocol import StorageLevel
from flashmemory.kvcache.levels.tensor_pool import TensorPool
from flashmemory.kvcache.kv_stats import SelectionStats
from flashmemory.kvcache.manager.blocks import BlockEntry, BlockManager, Level
from flashmemory.kvcache.quant import Codec, Parts
from flashmemory.kvcache.read.choice import ChoiceObserver, LayerChoice
from flashmemory.kvcache.read.hints import boost_hints, prompt_hints
from flashmemory.kvcache.read.plan import LevelPlan, plan_reads, primary_copy
from flashmemory.kvcache.read.selection import (DIGEST_DTYPE, block_scores, rescore_scores,
                                                select_blocks, top_blocks, top_rescored)
from flashmemory.kvcache.sequence_state import SequenceKV


class ReadThrough(Protocol):
    """Serves one level's layer reads, from memory where it read ahead and from the level otherwise."""

    def read_layer(self, slots: list[int], layer: int, seq_id: int, decoding: bool) -> Parts:
        """Parts [num_kv_heads, len(slots), ...] of one layer."""


class PerHeadSource(Protocol):
    """Gathers one layer's records with every KV head reading its own slots (e.g. from a device copy)."""

    def get_layer_per_head(self, slots: torch.Tensor, layer: int) -> Parts:
        """slots [heads, n] -> parts [heads, n, ...]."""


class SelectionKernel(Protocol):
    """Quest's choice in one call (e.g. the native kernel); None where it cannot take these tensors."""

    def select(self, q: torch.Tensor, digest: torch.Tensor, budget: int, indices: torch.Tensor | None = None,
               hints: torch.Tensor | None = None, scores: torch.Tensor | None = None) -> torch.Tensor | None:
        """What select_blocks(q, digest, budget) chooses, hinted blocks (logical `indices`) first; `scores`
        [num_kv_heads, n] float32, when given, receives the raw scores."""


class RescoreKernel(Protocol):
    """The two-pass read's key scores in one call (e.g. the native kernel); None where it cannot."""

    def scores(self, q: torch.Tensor, records: torch.Tensor, key_offset: int, key_dtype: torch.dtype,
               block_tokens: int, slots: torch.Tensor) -> torch.Tensor | None:
        """rescore_scores of the keys of `slots` [num_kv_heads, c], read in place in `records`."""


class BlockReader:
    """Owns the read path's choices and counters; reads blocks through the levels it was given."""

    def __init__(self, cfg: TieredCacheConfig, blocks: BlockManager, levels: dict[Level, StorageLevel],
                 codecs: dict[Level, Codec], observers: list[ChoiceObserver],
                 selection_kernel: SelectionKernel | None = None,
                 rescore_kernel: RescoreKernel | None = None) -> None:
        self.cfg = cfg
        self.blocks = blocks
        self.levels = levels
        self.codecs = codecs
        self.observers = observers  # shared with the cache: observers added later are seen here
        self._read_through: dict[Level, ReadThrough] = {}
        self._per_head: dict[Level, PerHeadSource] = {}
        self.selection_kernel = selection_kernel  # None: the torch path (read/selection.py) chooses
        self.rescore_kernel = rescore_kernel  # None: the torch path rescores
        # Per level below L0 (the levels a decode step chooses among), summed over decode steps and
        # layers.
        self.selected_blocks = {level: 0 for level in levels if level != Level.DEVICE}
        self.candidate_blocks = {level: 0 for level in levels if level != Level.DEVICE}
        self.keys_read_blocks = {level: 0 for level in levels if level != Level.DEVICE}
        self.selection_steps = 0  # decode steps that chose among old blocks (counted by the cache, at layer 0)
        self.selection_seconds = 0.0  # spent scoring and choosing, summed over steps, layers and levels
        self._devices = {level: (lvl.device if isinstance(lvl, TensorPool) else torch.device("cpu"))
                         for level, lvl in levels.items()}

    def use_read_through(self, level: Level, source: ReadThrough | None) -> None:
        """Read `level`'s layers through `source` (None: straight from the level)."""
        if source is None:
            self._read_through.pop(level, None)
        else:
            self._read_through[level] = source

    def use_per_head_source(self, level: Level, source: PerHeadSource | None) -> None:
        """Gather `level`'s per-head selections through `source` (None: from the level's own pool)."""
        if source is None:
            self._per_head.pop(level, None)
        else:
            self._per_head[level] = source

    def memory_pool(self, level: Level) -> TensorPool | None:
        """The level's in-memory pool, whose records a kernel can read in place; None for other media."""
        pool = self.levels.get(level)
        return pool if isinstance(pool, TensorPool) else None

    def plan(self, seq_id: int, seq: SequenceKV, decoding: bool, with_digest: bool) -> dict[Level, LevelPlan]:
        """Per level, the blocks this forward reads from it (computed once, used by every layer).

        A decode step reads each block's fastest copy. A prefill chunk reads the exact (FP16) copy wherever a
        block has one, so a prompt's KV does not depend on where the scheduler split its prefill (only blocks
        already moved to a lossy L2 are read lossy). The sequence's sink and recent full blocks are attended
        from its row (FP16), so no level reads them."""
        copy_of = primary_copy if decoding else self._exact_copy
        return plan_reads(seq_id, self.blocks.tables[seq_id], seq.num_tokens, seq.digest, self._devices, with_digest,
                          copy_of, skip_oldest=seq.num_sink // self.cfg.block_size,
                          skip_newest=seq.num_recent // self.cfg.block_size,
                          gathered=seq.digest_gathers if decoding else None)

    def _exact_copy(self, block: BlockEntry) -> Level:
        """The fastest copy stored without loss (FP16), else the fastest."""
        for level in sorted(block.slots):
            if self.codecs[level].bits == 16:
                return level
        return block.primary

    def budget(self, level: Level, num_candidates: int) -> int:
        """Blocks a decode step reads from a level: L1 a token budget, capped at a fraction of its
        blocks; each level below a fraction of its blocks; any at least the floor."""
        if level == Level.HOST:
            wanted = min(self.cfg.warm_budget_tokens // self.cfg.block_size,
                         int(self.cfg.warm_budget_fraction * num_candidates))  # at most: rounded down
        else:
            wanted = math.ceil(self.cfg.semantic_truncate_threshold * num_candidates)
        # NOTE: 15 % of a 1,000-token L2 is 10 blocks; a needle ranked 12th by its box bound was lost that way.
        floor = -(-self.cfg.selection_min_tokens // self.cfg.block_size)
        return max(1, min(num_candidates, max(wanted, floor)))

    def choose_batch(self, layer: int, q: torch.Tensor,
                     wanted: list[tuple[int, Level, LevelPlan]]) -> list[torch.Tensor]:
        """Query-aware choice of a decode batch's old blocks at one layer: for each (row b of q
        [B, num_heads, head_dim], level, plan) in `wanted`, [num_kv_heads, budget] positions on q's
        device. Scored where the digests are (host memory, sequence_state.py): on a GPU the
        batch's queries come to the host in one transfer and all its choices go back in one."""
        if not wanted:
            return []
        started = time.perf_counter()
        try:
            (host_q,) = self.transfer([q], wanted[0][2].digest.device)
            chosen = []
            for b, level, plan in wanted:
                with serving_sequence(plan.seq_id):
                    chosen.append(self._choose(level, plan, host_q[b : b + 1], layer))
            return self.transfer(chosen, q.device)
        finally:
            self.selection_seconds += time.perf_counter() - started

    @staticmethod
    def transfer(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        """`tensors` (of one dtype) on `device` in one copy; the same tensors if already there."""
        if all(t.device == device for t in tensors):
            return tensors
        if len(tensors) == 1:
            return [tensors[0].to(device)]
        moved = torch.cat([t.reshape(-1) for t in tensors]).to(device)
        parts = moved.split([t.numel() for t in tensors])
        return [part.view(t.shape) for part, t in zip(parts, tensors)]

    def _choose(self, level: Level, plan: LevelPlan, q: torch.Tensor, layer: int) -> torch.Tensor:
        n = len(plan.indices)
        budget = self.budget(level, n)
        self.candidate_blocks[level] += n
        self.selected_blocks[level] += budget
        picked = self._rescored_count(level, n, budget)  # what the bounds pick
        self.keys_read_blocks[level] += picked
        hints = plan.hints.get(layer) if plan.hints else None
        digest = plan.digest[layer]  # [heads, n, boxes * 2 * head_dim] (DIGEST_DTYPE)
        chosen = None
        if self.selection_kernel is not None:
            scores = digest.new_empty(digest.shape[:2], dtype=torch.float32) if self.observers else None
            indices = None if hints is None else _index_tensor(plan)
            chosen = self.selection_kernel.select(q[0], digest, picked, indices, hints, scores)
        if chosen is None:
            if not self.observers and hints is None and picked == budget:
                return select_blocks(q[0], digest, budget)
            scores = block_scores(q[0], digest)  # [heads, n]: observers see the scores behind the choice
            boosted = scores if hints is None else boost_hints(scores, _index_tensor(plan), hints)
            chosen = top_blocks(boosted, picked)
        if picked > budget:
            chosen = self._rescore(level, plan, q[0], layer, chosen, budget, hints)
        if not self.observers:
            return chosen
        heads = scores.shape[0]
        # Tensors stay where they are (on a GPU: no sync per layer); the observers move a whole step at once.
        choice = LayerChoice(plan.seq_id, plan.position, layer, int(level), _index_tensor(plan), scores, chosen,
                             q[0].float().reshape(heads, -1).mean(dim=1), plan.num_blocks, plan.slot_tensor)
        for observer in self.observers:
            observer.on_choose(choice)
        return chosen

    def _rescored_count(self, level: Level, num_candidates: int, budget: int) -> int:
        """Blocks the bounds pick for a two-pass read (selection_rescore_factor): only on a level
        whose FP16 keys are in memory (L1), else the budget itself."""
        factor = self.cfg.selection_rescore_factor
        pool = self.memory_pool(level)
        if factor <= 1 or pool is None or self.codecs[level].bits != 16:
            return budget
        return min(num_candidates, max(budget, int(budget * factor)))

    def _rescore(self, level: Level, plan: LevelPlan, q: torch.Tensor, layer: int,
                 candidates: torch.Tensor, budget: int, hints: torch.Tensor | None) -> torch.Tensor:
        """The second pass: the candidates' FP16 keys [heads, c] (positions into the plan) read, the
        `budget` with the most attention kept (hinted blocks always)."""
        pool = self.memory_pool(level)
        assert pool is not None
        slots = plan.slot_tensor[candidates.to(pool.device)]
        scores = None
        if self.rescore_kernel is not None and pool.device.type == "cpu":
            records, key_offset, key_dtype = pool.key_records(layer)
            scores = self.rescore_kernel.scores(q, records, key_offset, key_dtype, pool.block_size,
                                                slots)
        if scores is None:
            # [heads, c, bs, head_dim]
            keys = pool.get_layer_keys_per_head(slots, layer).to(q.device)
            scores = rescore_scores(q, keys)
        keep = None
        if hints is not None:
            logical = _index_tensor(plan).to(candidates.device)[candidates]  # [heads, c]
            keep = (logical[:, :, None] == hints.to(candidates.device)[:, None, :]).any(dim=-1)
        return candidates.gather(1, top_rescored(scores.to(candidates.device), budget, keep))

    def prompt_hints(self, plan: LevelPlan, q: torch.Tensor, layer: int) -> torch.Tensor | None:
        """At a prefill chunk, the old blocks its last queries point to: [num_kv_heads, k] logical indices, k from
        `selection_prompt_tokens` (None when off); see read/hints.py."""
        k = self.cfg.selection_prompt_tokens // self.cfg.block_size
        if k == 0 or plan.digest is None:
            return None
        return prompt_hints(q.to(plan.digest.device), plan.digest[layer], _index_tensor(plan), k)

    def gather(self, level: Level, plan: LevelPlan, chosen: torch.Tensor | None, layer: int, dtype: torch.dtype,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Keys and values [2, num_kv_heads, tokens, head_dim] of one level's blocks (or of the `chosen` positions
        [num_kv_heads, budget] per KV head), decoded for one layer; written into `out` when given."""
        heads, head_dim, bs = self.cfg.num_kv_heads, self.cfg.head_dim, self.cfg.block_size
        compute = torch.promote_types(dtype, torch.float32)
        codec = self.codecs[level]
        count = len(plan.indices) if chosen is None else chosen.shape[1]
        if out is None:
            out = torch.empty((2, heads, count * bs, head_dim), dtype=compute, device=self.cfg.device)
        blocks_out = out.view(2, heads, count, bs, head_dim)
        pool = self.memory_pool(level)
        if chosen is not None and pool is not None and codec.bits == 16:
            # Unquantized pool: gather each KV head's own blocks straight from storage, in one index_select
            # (through the level's per-head source where one is plugged in, e.g. L1 blocks staged on the device).
            slots = plan.slot_tensor[chosen.to(pool.device)]
            parts = self._per_head.get(level, pool).get_layer_per_head(slots, layer)
            codec.decode({name: t.to(self.cfg.device) for name, t in parts.items()}, compute, out=blocks_out)
            return out
        if chosen is None:
            needed = None
        else:
            # Each KV head reads its own blocks; decode their union once, then pick per head.
            needed, pos = torch.unique(chosen, sorted=True, return_inverse=True)  # pos: [heads, budget]
        parts = self._read_layer(level, plan, needed, layer, decoding=chosen is not None)
        parts = {name: t.to(self.cfg.device) for name, t in parts.items()}
        if needed is None:
            codec.decode(parts, compute, out=blocks_out)  # straight into place
        else:
            kv = codec.decode(parts, compute)  # [2, heads, union, block_size, head_dim]
            blocks_out.copy_(kv[:, torch.arange(heads, device=kv.device)[:, None], pos])
        return out

    def records(self, level: Level, plan: LevelPlan, chosen: torch.Tensor, layer: int) -> tuple[torch.Tensor,
                                                                                                  torch.Tensor]:
        """The `chosen` blocks [num_kv_heads, budget] of one layer as coded records, not decoded: (records
        [num_kv_heads, n, record_bytes] in the codec's record layout, positions [num_kv_heads, budget] int64 into
        them), for a kernel that folds records in place. For a level read as parts (the disk level): the union
        of the heads' blocks is read once and its parts laid out as records, each head's own blocks among them."""
        heads, bs, head_dim = self.cfg.num_kv_heads, self.cfg.block_size, self.cfg.head_dim
        needed, pos = torch.unique(chosen, sorted=True, return_inverse=True)
        parts = self._read_layer(level, plan, needed, layer, decoding=True)  # {name: [heads, n, ...]}
        codec = self.codecs[level]
        layout, record_bytes = codec.record_layout(bs, head_dim), codec.nbytes((), bs, head_dim)
        n = needed.numel()
        out = torch.empty((heads, n, record_bytes), dtype=torch.uint8)
        for name, (offset, size, _, _) in layout.items():
            out[:, :, offset: offset + size].copy_(parts[name].contiguous().view(torch.uint8).reshape(heads, n, size))
        return out, pos

    def _read_layer(self, level: Level, plan: LevelPlan, needed: torch.Tensor | None, layer: int,
                    decoding: bool) -> Parts:
        """Parts [heads, blocks, ...] of the plan's blocks (or the `needed` positions of them) for one layer."""
        pool = self.memory_pool(level)
        if pool is not None:
            slot_tensor = plan.slot_tensor if needed is None else plan.slot_tensor[needed.to(pool.device)]
            return pool.get_layer(slot_tensor, layer)
        slots = plan.slots if needed is None else [plan.slots[i] for i in needed.tolist()]
        source = self._read_through.get(level)
        if source is not None:
            return source.read_layer(slots, layer, plan.seq_id, decoding)
        return self.levels[level].read_layer(slots, layer)

    def selection_stats(self, digests: Iterable[torch.Tensor | None]) -> SelectionStats:
        """Query-aware selection: share of the old blocks (every level below L0) read per decode
        step, its time, and the digests' memory (`digests`: each live sequence's digest store); per
        level: `level_selection`."""
        candidates = sum(self.candidate_blocks.values())
        steps = self.selection_steps
        cfg = self.cfg
        selected = sum(self.selected_blocks.values())
        return SelectionStats(
            selection_steps=steps,
            selection_old_read_fraction=selected / candidates if candidates else 0.0,
            selection_old_keys_read_fraction=(sum(self.keys_read_blocks.values()) / candidates
                                              if candidates else 0.0),
            selection_ms_per_step=self.selection_seconds / steps * 1e3 if steps else 0.0,
            # centre and radius per channel, box, layer and KV head (DIGEST_DTYPE): per token of history, held now
            selection_digest_bytes_per_token=cfg.num_layers * cfg.num_kv_heads * 2 * cfg.head_dim
            * DIGEST_DTYPE.itemsize * cfg.digest_boxes / cfg.block_size,
            selection_digest_bytes=sum(d.numel() * d.element_size()
                                       for d in digests if d is not None),
        )

    def level_selection(self, level: int) -> tuple[int, float] | None:
        """(candidate blocks summed over decode steps and layers, the share attended) of a level
        below L0; None for L0 (never chosen among)."""
        if level not in self.candidate_blocks:
            return None
        cand = self.candidate_blocks[level]
        return cand, self.selected_blocks[level] / cand if cand else 0.0


def _index_tensor(plan: LevelPlan) -> torch.Tensor:
    """The plan's logical block indices as a CPU int64 tensor, made once per forward."""
    if plan.index_tensor is None:
        plan.index_tensor = torch.as_tensor(plan.indices, dtype=torch.int64)
    return plan.index_tensor
