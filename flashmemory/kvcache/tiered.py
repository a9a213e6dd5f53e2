"""TieredKVCache: KV in paged blocks over three levels (L0 device INT4, L1 host FP16, L2 disk INT2).

Every full block gets an FP16 master copy in L1 when it is written, plus an L0 copy while it is hot (attention
sinks, pinned spans, the last `active_window` tokens). Leaving the window drops the L0 copy; leaving the warm
span re-encodes the FP16 copy for L2 and frees L1. Decode steps attend to all of L0, the newest still-filling
block (never quantized), and the blocks of L1 and L2 that query-aware selection picks per layer and KV head.
The read path (plans, selection, gathers, decode attention) lives in tiered_read.py, the moves between levels in
placement.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from flashmemory.errors import CapacityError
from flashmemory.kvcache import native
from flashmemory.kvcache.prefetch.access_trace import TraceRecorder
from flashmemory.kvcache.manager.blocks import BlockManager, Level
from flashmemory.kvcache.prefetch.device_staging import DeviceStaging
from flashmemory.kvcache.levels.disk_pool import DiskPool
from flashmemory.kvcache.prefetch.heat_predictor import HeatPredictor
from flashmemory.kvcache.interface import ForwardBatch, KVCache, SequenceSlice
from flashmemory.kvcache.placement import PlacementMixin
from flashmemory.kvcache.levels.tensor_pool import TensorPool
from flashmemory.kvcache.prefetch.prefetcher import Prefetcher
from flashmemory.kvcache.read.selection import key_digest
from flashmemory.kvcache.attention.partial import merge_partials, partial_attention
from flashmemory.kvcache.config import KV_DTYPE, TieredCacheConfig, level_codecs
from flashmemory.kvcache.read.reader import ChoiceObserver, LevelPlan, ReadPathMixin

log = logging.getLogger(__name__)


@dataclass
class _Sequence:
    staging_index: int  # row of the staging arena holding the still-filling block
    num_tokens: int = 0  # committed tokens (full blocks + staged)
    num_staged: int = 0
    digest: torch.Tensor | None = None  # [num_layers, num_kv_heads, capacity_blocks, 2 * head_dim] (key_digest)
    pending: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # per layer, this forward
    plan: dict[Level, LevelPlan] | None = None  # built at layer 0 of a forward, dropped at commit
    pinned_spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) token ranges kept in L0


class TieredKVCache(PlacementMixin, ReadPathMixin, KVCache):
    """Owns the three pools, the block tables and the per-sequence digests; computes tiered attention."""

    def __init__(self, cfg: TieredCacheConfig) -> None:
        self.cfg = cfg
        self.codecs = level_codecs(cfg.kv_precision, cfg.block_size, cfg.head_dim)
        geometry = (cfg.num_layers, cfg.num_kv_heads, cfg.block_size, cfg.head_dim)
        self.device_pool = TensorPool(Level.DEVICE, self.codecs[Level.DEVICE], cfg.device_slots, *geometry, cfg.device)
        pin = cfg.device.type == "cuda"
        self.host_pool = TensorPool(Level.HOST, self.codecs[Level.HOST], cfg.host_slots, *geometry,
                                    torch.device("cpu"), pin_memory=pin)
        self.disk_pool = None
        slots = {Level.DEVICE: cfg.device_slots, Level.HOST: cfg.host_slots}
        if cfg.cold_zone_enabled:
            self.disk_pool = DiskPool(self.codecs[Level.DISK], cfg.disk_slots, *geometry, cfg.cold_zone_dir,
                                      cfg.model_fingerprint)
            slots[Level.DISK] = cfg.disk_slots
        self.blocks = BlockManager(slots)
        # The newest, still-filling block of each sequence: unquantized, in the device arena.
        self.staging = torch.zeros((cfg.max_num_seqs, 2, cfg.num_layers, cfg.num_kv_heads, cfg.block_size,
                                    cfg.head_dim), dtype=KV_DTYPE, device=cfg.device)
        self._free_staging = list(range(cfg.max_num_seqs))
        self.seqs: dict[int, _Sequence] = {}
        # Decode steps read L0/L1 blocks through the compiled kernel where it is available (CPU, float32).
        self._native = native.supports(cfg.block_size, cfg.head_dim, cfg.device, torch.float32)
        self.bytes_moved: dict[str, int] = {"L0->L1": 0, "L1->L2": 0, "new->L0": 0, "new->L1": 0}
        self.selected_blocks = {Level.HOST: 0, Level.DISK: 0}
        self.candidate_blocks = {Level.HOST: 0, Level.DISK: 0}
        # Objects told of every query-aware choice (trace recorder, prefetcher); none = no scoring overhead.
        self.choice_observers: list[ChoiceObserver] = []
        self.trace: TraceRecorder | None = None
        if cfg.record_traces:
            self.trace = TraceRecorder()
            self.choice_observers.append(self.trace)
        self.prefetcher: Prefetcher | None = None
        # L1 blocks copied to the device ahead of the decode step that reads them (GPU hosts; the torch decode path).
        self.device_staging: DeviceStaging | None = None
        if cfg.device_staging_bytes > 0:
            if cfg.device.type == "cpu":
                log.warning("device_staging_mb on a CPU host: L1 already is the compute's memory, staging only adds "
                            "copies (and the decode kernel reads L1 in place)")
            self.device_staging = DeviceStaging(self.host_pool, cfg.device, cfg.device_staging_bytes)
        if self.disk_pool is not None:
            self.disk_pool.set_uncached_reads(cfg.cold_zone_uncached_reads)
        if cfg.prefetch_strategy != "none" and (self.disk_pool is not None or self.device_staging is not None):
            predictor = HeatPredictor.load(cfg.heat_predictor_path) if cfg.prefetch_ranker == "predictor" else None
            self.use_prefetcher(Prefetcher(self.disk_pool, cfg.num_layers, cfg.num_kv_heads, cfg.prefetch_strategy,
                                           cfg.prefetch_budget_bytes, cfg.prefetch_ranker, predictor,
                                           device_staging=self.device_staging))

    def use_prefetcher(self, prefetcher: Prefetcher | None) -> Prefetcher | None:
        """Swap the L2 prefetcher (None: read L2 on demand only); returns the previous one, still open."""
        previous = self.prefetcher
        if previous is not None:
            self.choice_observers.remove(previous)
        self.prefetcher = prefetcher
        if prefetcher is not None:
            self.choice_observers.append(prefetcher)
        return previous

    # ---- sequence lifecycle -----------------------------------------------------------------------------------

    def add_sequence(self, seq_id: int) -> None:
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id} already exists")
        if not self._free_staging:
            raise CapacityError(
                f"{self.cfg.max_num_seqs} sequences are already alive (max_num_seqs); finish one or raise max_num_seqs"
            )
        self.blocks.add_sequence(seq_id)
        self.seqs[seq_id] = _Sequence(staging_index=self._free_staging.pop())

    def free_sequence(self, seq_id: int) -> None:
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            return
        for level, slot in self.blocks.free_sequence(seq_id):
            if level == Level.DISK and self.disk_pool is not None:
                self.disk_pool.free(slot)
        self._free_staging.append(seq.staging_index)
        if self.prefetcher is not None:
            self.prefetcher.forget(seq_id)

    def sequence_ids(self) -> list[int]:
        return list(self.seqs)

    def num_tokens(self, seq_id: int) -> int:
        return self.seqs[seq_id].num_tokens

    def pin_span(self, seq_id: int, start: int, end: int) -> None:
        """Keep tokens [start, end) of the sequence in L0 whatever the window (e.g. a system prompt)."""
        seq = self.seqs[seq_id]
        seq.pinned_spans.append((start, end))
        bs = self.cfg.block_size
        table = self.blocks.tables[seq_id]
        for i in range(start // bs, min(len(table.blocks), -(-end // bs))):
            table.blocks[i].pinned = True
            if Level.DEVICE not in table.blocks[i].slots:
                self._promote_to_device(seq_id, i)

    # ---- attention --------------------------------------------------------------------------------------------

    def attend_sequence(self, layer: int, s: SequenceSlice, q, k, v) -> torch.Tensor:
        # q: [n, num_heads, head_dim]; k, v: [n, num_kv_heads, head_dim]
        seq = self.seqs[s.seq_id]
        new_k = k.transpose(0, 1).to(KV_DTYPE)  # [num_kv_heads, n, head_dim]
        new_v = v.transpose(0, 1).to(KV_DTYPE)
        seq.pending.append((new_k, new_v))
        staged = self.staging[seq.staging_index, :, layer, :, : seq.num_staged]  # [2, num_kv_heads, staged, head_dim]
        decoding = s.num_new_tokens == 1 and self.cfg.selection == "quest"
        if seq.plan is None:
            seq.plan = self._plan(s.seq_id, with_digest=decoding)
        if s.num_new_tokens == 1:
            return self._attend_decode(layer, seq, q, staged, new_k, new_v, decoding)
        # Prefill chunk: causal among the new tokens, all earlier blocks visible; partials merged by LSE.
        recent_k = torch.cat((staged[0], new_k), dim=1)
        recent_v = torch.cat((staged[1], new_v), dim=1)
        partials = [partial_attention(q, recent_k, recent_v, causal_offset=seq.num_staged)]
        for level, plan in seq.plan.items():
            kv = self._gather(level, plan, None, layer, q.dtype)
            partials.append(partial_attention(q, kv[0], kv[1]))
        return merge_partials(partials).to(q.dtype)

    # ---- commit and placement ---------------------------------------------------------------------------------

    def commit(self, batch: ForwardBatch) -> None:
        for s in batch.slices:
            self._commit_one(s)
            if s.num_new_tokens == 1:
                for observer in self.choice_observers:
                    observer.on_step_end(s.seq_id)

    def _commit_one(self, s: SequenceSlice) -> None:
        seq = self.seqs[s.seq_id]
        seq.plan = None
        cfg = self.cfg
        staged = self.staging[seq.staging_index, :, :, :, : seq.num_staged]  # [2, L, heads, staged, D]
        new_k = torch.stack([pk for pk, _ in seq.pending])  # [L, heads, n, D]
        new_v = torch.stack([pv for _, pv in seq.pending])
        seq.pending.clear()
        all_k = torch.cat((staged[0], new_k), dim=2)
        all_v = torch.cat((staged[1], new_v), dim=2)
        total = all_k.shape[2]
        full = total // cfg.block_size
        for b in range(full):
            sl = slice(b * cfg.block_size, (b + 1) * cfg.block_size)
            self._write_block(s.seq_id, all_k[:, :, sl], all_v[:, :, sl])
        rest = total - full * cfg.block_size
        if rest:
            self.staging[seq.staging_index, 0, :, :, :rest] = all_k[:, :, full * cfg.block_size :]
            self.staging[seq.staging_index, 1, :, :, :rest] = all_v[:, :, full * cfg.block_size :]
        seq.num_staged = rest
        seq.num_tokens += s.num_new_tokens
        self._place(s.seq_id)

    def _write_block(self, seq_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """A block just filled: k, v [num_layers, num_kv_heads, block_size, head_dim] in KV_DTYPE."""
        seq = self.seqs[seq_id]
        cfg = self.cfg
        index = len(self.blocks.tables[seq_id].blocks)
        start = index * cfg.block_size
        pinned = index < cfg.num_sink_blocks or any(a < start + cfg.block_size and start < b
                                                    for a, b in seq.pinned_spans)
        # Take both slots before the block enters the table, so a full level leaves no half-placed block behind.
        host_slot = self._allocate(Level.HOST)
        try:
            device_slot = self._allocate(Level.DEVICE)
        except CapacityError:
            self.blocks.allocators[Level.HOST].free(host_slot)
            raise
        self.host_pool.put(host_slot, self.codecs[Level.HOST].encode(k, v))
        self.device_pool.put(device_slot, self.codecs[Level.DEVICE].encode(k, v))
        self.blocks.append_block(seq_id, pinned=pinned)
        self.blocks.attach(seq_id, index, Level.HOST, host_slot)
        self.blocks.attach(seq_id, index, Level.DEVICE, device_slot)
        self.bytes_moved["new->L1"] += self.host_pool.bytes_per_slot
        self.bytes_moved["new->L0"] += self.device_pool.bytes_per_slot
        # Digest for selection: per layer and KV head, the centre and radius of the block's key channels.
        digest = key_digest(k)  # [L, heads, 2 * D]
        if seq.digest is None or seq.digest.shape[2] <= index:
            capacity = max(64, 2 * (index + 1))
            num_layers, heads, width = digest.shape
            grown = torch.empty((num_layers, heads, capacity, width), dtype=torch.float32, device=cfg.device)
            if seq.digest is not None:
                grown[:, :, : seq.digest.shape[2]] = seq.digest
            seq.digest = grown
        seq.digest[:, :, index] = digest

    # ---- reporting --------------------------------------------------------------------------------------------

    def device_bytes_used(self) -> int:
        """Bytes of KV held in device memory now: L0 slots in use, the staging blocks of live sequences and the L1
        blocks staged on the device ahead of need."""
        staging = self.staging[0].numel() * self.staging.element_size()
        used = self.blocks.allocators[Level.DEVICE].num_used * self.device_pool.bytes_per_slot
        ahead = self.device_staging.stats()["device_staging_bytes"] if self.device_staging is not None else 0
        return int(used + staging * len(self.seqs) + ahead)

    def device_bytes_capacity(self) -> int:
        ahead = self.device_staging.area.numel() if self.device_staging is not None else 0
        return self.device_pool.capacity_bytes + self.staging.numel() * self.staging.element_size() + ahead

    def stats(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {
            "num_sequences": len(self.seqs),
            "num_tokens": sum(s.num_tokens for s in self.seqs.values()),
        }
        pools = {Level.DEVICE: self.device_pool, Level.HOST: self.host_pool, Level.DISK: self.disk_pool}
        for level, st in self.blocks.level_stats().items():
            name = f"L{int(level)}"
            pool = pools[level]
            out[f"{name}_blocks"] = st["slots_used"]
            out[f"{name}_blocks_total"] = st["slots_total"]
            out[f"{name}_bytes"] = st["slots_used"] * pool.bytes_per_slot
            out[f"{name}_bytes_capacity"] = pool.capacity_bytes
        out["L0_bytes"] = self.device_bytes_used()
        out["L0_bytes_capacity"] = self.device_bytes_capacity()
        for level in (Level.HOST, Level.DISK):
            cand = self.candidate_blocks[level]
            out[f"L{int(level)}_candidate_blocks"] = cand  # summed over decode steps, layers
            out[f"L{int(level)}_selected_fraction"] = self.selected_blocks[level] / cand if cand else 0.0
        for route, n in self.bytes_moved.items():
            out[f"bytes_moved_{route}"] = n
        if self.disk_pool is not None:
            out["L2_bytes_read"] = self.disk_pool.bytes_read
            for reason, n in self.disk_pool.load_failures.items():
                out[f"L2_load_failures_{reason}"] = n
        if self.prefetcher is not None:
            out.update(self.prefetcher.stats())
        if self.device_staging is not None:
            out.update(self.device_staging.stats())
        return out

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
        if self.device_staging is not None:
            self.device_staging.close()
        if self.disk_pool is not None:
            self.disk_pool.close()
