"""The decode read path of TieredKVCache: which blocks a forward reads from each level (its plan), the query-aware
choice among L1 / L2 blocks, their gather and decode, and the fused decode attention over all levels (through the
compiled kernel where it is available).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from flashmemory.kvcache import native
from flashmemory.kvcache.prefetch.access_stats import LayerChoice
from flashmemory.kvcache.attention.dense import causal_attention
from flashmemory.kvcache.manager.blocks import BlockManager, Level
from flashmemory.kvcache.native import DecodeState
from flashmemory.kvcache.read.selection import block_scores, select_blocks, top_blocks

if TYPE_CHECKING:
    from flashmemory.kvcache.prefetch.device_staging import DeviceStaging
    from flashmemory.kvcache.levels.disk_pool import DiskPool
    from flashmemory.kvcache.levels.tensor_pool import TensorPool
    from flashmemory.kvcache.prefetch.prefetcher import Prefetcher
    from flashmemory.kvcache.quant import Codec
    from flashmemory.kvcache.tiered import _Sequence
    from flashmemory.kvcache.config import TieredCacheConfig


@dataclass
class LevelPlan:
    """What one forward reads from one level for one sequence (the same for every layer)."""

    indices: list[int]  # logical block indices whose primary copy is on the level, in order
    slots: list[int]
    slot_tensor: torch.Tensor  # int64 slots on the pool's device (L2: on the CPU)
    digest: torch.Tensor | None  # [num_layers, num_kv_heads, blocks, 2 * head_dim] for selection (a view if contiguous)
    seq_id: int = -1
    position: int = 0  # the sequence's tokens before this forward (the decode step's clock)
    num_blocks: int = 0  # full blocks of the sequence
    index_tensor: torch.Tensor | None = None  # `indices` as a CPU int64 tensor (made once, for choice observers)


class ChoiceObserver(Protocol):
    """Told of every query-aware choice a decode step makes, and of the step's end (all layers read)."""

    def on_choose(self, choice: LayerChoice) -> None: ...

    def on_step_end(self, seq_id: int) -> None: ...


class ReadPathMixin:
    """Reads blocks for TieredKVCache's forwards (which owns the state named below)."""

    cfg: TieredCacheConfig
    blocks: BlockManager
    codecs: dict[Level, Codec]
    device_pool: TensorPool
    host_pool: TensorPool
    disk_pool: DiskPool | None
    prefetcher: Prefetcher | None
    device_staging: DeviceStaging | None
    seqs: dict[int, _Sequence]
    choice_observers: list[ChoiceObserver]
    selected_blocks: dict[Level, int]
    candidate_blocks: dict[Level, int]
    _native: bool

    def _pool(self, level: Level) -> TensorPool:
        """The in-memory pool of L0 or L1."""
        return self.device_pool if level == Level.DEVICE else self.host_pool

    def _attend_decode(self, layer: int, seq: _Sequence, q, staged, new_k, new_v, decoding: bool) -> torch.Tensor:
        """One query sees every key it is given: write all levels' keys and values into one buffer (decoding
        straight into it) and run a single fused attention — no causal mask, no partial results to merge."""
        if self._native and q.dtype == torch.float32 and q.shape[1] <= native.MAX_GROUP * self.cfg.num_kv_heads:
            return self._attend_decode_native(layer, seq, q, staged, new_k, new_v, decoding)
        heads, head_dim, bs = self.cfg.num_kv_heads, self.cfg.head_dim, self.cfg.block_size
        compute = torch.promote_types(q.dtype, torch.float32)
        chosen = {level: self._choose(level, plan, q, layer) if decoding and level != Level.DEVICE else None
                  for level, plan in seq.plan.items()}
        n_staged = staged.shape[2]
        sizes = [n_staged + 1] + [bs * (len(plan.indices) if chosen[level] is None else chosen[level].shape[1])
                                  for level, plan in seq.plan.items()]
        kv = torch.empty((2, heads, sum(sizes), head_dim), dtype=compute, device=q.device)  # K then V
        kv[:, :, :n_staged] = staged
        kv[0, :, n_staged : n_staged + 1] = new_k
        kv[1, :, n_staged : n_staged + 1] = new_v
        start = sizes[0]
        for (level, plan), size in zip(seq.plan.items(), sizes[1:]):
            self._gather(level, plan, chosen[level], layer, compute, out=kv[:, :, start : start + size])
            start += size
        return causal_attention(q.to(compute), kv[0], kv[1], kv.shape[2] - 1).to(q.dtype)

    def _attend_decode_native(self, layer: int, seq: _Sequence, q, staged, new_k, new_v, decoding: bool) -> torch.Tensor:
        """`_attend_decode` through the compiled kernel: L0 and L1 blocks are read straight from their pools'
        records (INT4 / FP16) and folded into one online softmax; nothing is decoded into a float buffer first."""
        heads = self.cfg.num_kv_heads
        state = DecodeState(native.library(), q[0], heads)
        state.add_dense(torch.cat((staged[0], new_k), dim=1), torch.cat((staged[1], new_v), dim=1))
        for level, plan in seq.plan.items():
            chosen = self._choose(level, plan, q, layer) if decoding and level != Level.DEVICE else None
            if level == Level.DISK:  # read from the file as parts, not records: decode, then fold
                kv = self._gather(level, plan, chosen, layer, torch.float32)
                state.add_dense(kv[0], kv[1])
                continue
            pool = self._pool(level)
            slots = plan.slot_tensor.expand(heads, -1) if chosen is None else plan.slot_tensor[chosen]
            state.add_records(pool.storage[layer], slots, pool.record_format)
        return state.output().unsqueeze(0)

    def _choose(self, level: Level, plan: LevelPlan, q: torch.Tensor, layer: int) -> torch.Tensor:
        """Query-aware choice of a level's blocks for one decode step: [num_kv_heads, budget] positions."""
        budget = self._budget(level, len(plan.indices))
        self.candidate_blocks[level] += len(plan.indices)
        self.selected_blocks[level] += budget
        if not self.choice_observers:
            return select_blocks(q[0], plan.digest[layer], budget)
        scores = block_scores(q[0], plan.digest[layer])  # [heads, n]: observers see the scores behind the choice
        chosen = top_blocks(scores, budget)
        heads = scores.shape[0]
        if plan.index_tensor is None:
            plan.index_tensor = torch.as_tensor(plan.indices, dtype=torch.int64)
        # Tensors stay where they are (on a GPU: no sync per layer); the observers move a whole step at once.
        choice = LayerChoice(plan.seq_id, plan.position, layer, int(level), plan.index_tensor, scores, chosen,
                             q[0].float().reshape(heads, -1).mean(dim=1), plan.num_blocks, plan.slot_tensor)
        for observer in self.choice_observers:
            observer.on_choose(choice)
        return chosen

    def _plan(self, seq_id: int, with_digest: bool) -> dict[Level, LevelPlan]:
        """Per level, the blocks this forward reads from it (computed once, used by every layer)."""
        seq = self.seqs[seq_id]
        table = self.blocks.tables[seq_id]
        plans = {}
        for level in Level:
            indices = table.blocks_on(level)
            if not indices:
                continue
            slots = [table.blocks[i].slots[level] for i in indices]
            device = self._pool(level).device if level != Level.DISK else torch.device("cpu")
            slot_tensor = torch.as_tensor(slots, dtype=torch.int64, device=device)
            digest = None
            if with_digest and level != Level.DEVICE:
                contiguous = indices[-1] - indices[0] + 1 == len(indices)  # the usual case: one run of blocks
                if contiguous:
                    digest = seq.digest[:, :, indices[0] : indices[-1] + 1]
                else:
                    digest = seq.digest[:, :, torch.as_tensor(indices, device=self.cfg.device)]
            plans[level] = LevelPlan(indices, slots, slot_tensor, digest, seq_id, seq.num_tokens, len(table.blocks))
        return plans

    def _budget(self, level: Level, num_candidates: int) -> int:
        if level == Level.HOST:
            wanted = self.cfg.warm_budget_tokens // self.cfg.block_size
        else:
            wanted = math.ceil(self.cfg.semantic_truncate_threshold * num_candidates)
        return max(1, min(num_candidates, wanted))

    def _gather(self, level: Level, plan: LevelPlan, chosen: torch.Tensor | None, layer: int, dtype: torch.dtype,
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
        if chosen is not None and level != Level.DISK and codec.bits == 16:
            # Unquantized pool: gather each KV head's own blocks straight from storage, in one index_select (L1
            # blocks staged on the device ahead of need come from the staging area).
            pool = self._pool(level)
            slots = plan.slot_tensor[chosen.to(pool.device)]
            if level == Level.HOST and self.device_staging is not None:
                parts = self.device_staging.gather_parts(layer, slots)
            else:
                parts = pool.get_layer_per_head(slots, layer)
            codec.decode({name: t.to(self.cfg.device) for name, t in parts.items()}, compute, out=blocks_out)
            return out
        if chosen is None:
            needed = None
        else:
            # Each KV head reads its own blocks; decode their union once, then pick per head.
            needed, pos = torch.unique(chosen, sorted=True, return_inverse=True)  # pos: [heads, budget]
        if level == Level.DISK:
            assert self.disk_pool is not None
            slots = plan.slots if needed is None else [plan.slots[i] for i in needed.tolist()]
            if self.prefetcher is not None:
                read = self.prefetcher.get_layer(slots, layer, plan.seq_id, decoding=chosen is not None)
            else:
                read = self.disk_pool.get_layer(slots, layer)
            parts = {name: t.transpose(0, 1) for name, t in read.items()}
        else:
            pool = self._pool(level)
            slot_tensor = plan.slot_tensor if needed is None else plan.slot_tensor[needed.to(pool.device)]
            parts = pool.get_layer(slot_tensor, layer)
        parts = {name: t.to(self.cfg.device) for name, t in parts.items()}
        if needed is None:
            codec.decode(parts, compute, out=blocks_out)  # straight into place
        else:
            kv = codec.decode(parts, compute)  # [2, heads, union, block_size, head_dim]
            blocks_out.copy_(kv[:, torch.arange(heads, device=kv.device)[:, None], pos])
        return out
