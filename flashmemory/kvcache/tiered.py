"""TieredKVCache: KV in paged blocks over an ordered list of levels (by default L0 device INT4, L1
host FP16, L2 disk INT4 (INT2 with int2-disk); TieredCacheConfig.hierarchy() lists them,
manager/hierarchy.py says how).

The composition root of the hierarchy. Every full block gets an FP16 master copy in L1 when it is written, plus an
L0 copy while it is hot (attention sinks, pinned spans, the last `active_window` tokens); where each block lives
afterwards is the PlacementPolicy's rule, carried out by Placement. Decode steps attend to all of L0 (its newest
blocks through the FP16 copies RecentRows keeps, with the still-filling block), and the blocks of L1 and L2 that
the BlockReader's query-aware choice picks per layer and KV head, through the selected AttentionBackend.
Prefetch, when configured, plugs into the read path as a choice observer and as a read-ahead source for L1 / L2.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from flashmemory.errors import ColdBlockError, SessionsUnavailableError, blame_sequence, serving_sequence
from flashmemory.kvcache.attention.backend import AttentionBackend, LevelRead
from flashmemory.kvcache.attention.registry import select_backend
from flashmemory.kvcache.config import KV_DTYPE, TieredCacheConfig, hierarchy_codecs
from flashmemory.kvcache.forward_plan import ForwardPlanner
from flashmemory.kvcache.interface import ForwardBatch, KVCache, SequenceSlice, kept_tokens
from flashmemory.kvcache.kv_stats import KVStats
from flashmemory.kvcache.levels.protocol import StorageLevel
from flashmemory.kvcache.levels.registry import build_levels
from flashmemory.kvcache.locality import LinkMonitor, LocalityPlacer, LocalityTracker
from flashmemory.kvcache.manager.blocks import BlockEntry, BlockManager, Level
from flashmemory.kvcache.manager.capacity import KVCapacity
from flashmemory.kvcache.manager.policy import LocalityPolicy
from flashmemory.kvcache.manager.prefix_cache import PrefixCache, chain_hashes
from flashmemory.kvcache.native import native_rescore, native_selection, use_native_reads
from flashmemory.kvcache.placement import Placement
from flashmemory.kvcache.preload import PreloadResult, preload_prefix
from flashmemory.kvcache.prefix_store import PrefixStore
from flashmemory.kvcache.sessions import CacheSessions
from flashmemory.kvcache.tiered_stats import tiered_stats
from flashmemory.kvcache.prefetch import build_prefetch
from flashmemory.kvcache.prefetch.access_trace import TraceRecorder
from flashmemory.kvcache.prefetch.device_staging import DeviceStaging
from flashmemory.kvcache.prefetch.prefetcher import Prefetcher
from flashmemory.kvcache.read.choice import ChoiceObserver
from flashmemory.kvcache.read.reader import BlockReader
from flashmemory.kvcache.read.selection import key_digest
from flashmemory.kvcache.recent_rows import RecentRows, row_layout
from flashmemory.kvcache.remote.importer import import_shared_prefix
from flashmemory.kvcache.remote.shared_level import SharedLevel, shared_level_for
from flashmemory.kvcache.sequence_state import SequenceKV


class TieredKVCache(KVCache):
    """Owns the levels, the block tables, the per-sequence state and the recent-token rows; composes placement,
    the read path, the attention backend and (optionally) prefetch."""

    def __init__(self, cfg: TieredCacheConfig) -> None:
        self.cfg = cfg
        self.hierarchy = cfg.hierarchy()  # the levels in order, from the settings
        self.policy = cfg.build_placement_policy()
        self.codecs = hierarchy_codecs(self.hierarchy, cfg.block_size, cfg.head_dim,
                                       cfg.kv_quant_range)
        self.levels: dict[int, StorageLevel] = build_levels(cfg, self.hierarchy, self.codecs)
        for storage in self.levels.values():
            use_native_reads(storage)  # a file's segments read in batches (C)
        self.prefix_cache = (PrefixCache(cfg.block_size, cfg.prefix_namespace(), len(self.levels))
                             if cfg.prefix_caching else None)
        # Decode reads differ from prefill's FP16 reads (a quantized window copy or query-aware selection).
        self._approximate_decode = cfg.selection != "exact" or cfg.kv_precision != "fp16"
        self.blocks = BlockManager({level: lvl.num_slots for level, lvl in self.levels.items()}, self.prefix_cache)
        # Objects told of every query-aware choice (trace recorder, prefetcher, locality); none = no
        # scoring overhead.
        self.choice_observers: list[ChoiceObserver] = []
        self.locality: LocalityPlacer | None = None
        if isinstance(self.policy, LocalityPolicy):
            tracker = LocalityTracker(cfg.locality_history_steps)
            self.choice_observers.append(tracker)
            self.locality = LocalityPlacer(self.policy, tracker, LinkMonitor(cfg.device),
                                           lambda: sum(self.placement.bytes_moved.values()))
        self.placement = Placement(self.policy, self.blocks, self.levels, self.codecs,
                                   self.hierarchy, self._cached_slots(), self.locality)
        self.reader = BlockReader(cfg, self.blocks, self.levels, self.codecs, self.choice_observers,
                                  native_selection(torch.device("cpu")),  # digests live on the host
                                  native_rescore(torch.device("cpu")))  # so do the L1 keys
        self.attention: AttentionBackend = select_backend(cfg.attention_backend, cfg)
        # The newest tokens of each sequence, unquantized in device memory: the still-filling block and, with
        # recent_fp16_tokens, the last full blocks and the sink blocks (attended here, not through INT4 L0 copies).
        recent, sink = row_layout(cfg.recent_fp16_tokens, cfg.block_size, cfg.active_window, cfg.num_sink_blocks,
                                  self.codecs[Level.DEVICE].bits)
        self.rows = RecentRows(cfg.max_num_seqs, cfg.num_layers, cfg.num_kv_heads, cfg.block_size, cfg.head_dim,
                               recent, sink, cfg.device)
        self.seqs: dict[int, SequenceKV] = {}
        self.planner = ForwardPlanner(cfg, self.reader, self.rows, self.seqs)
        self.trace: TraceRecorder | None = None
        if cfg.record_traces:
            self.trace = TraceRecorder()
            self.choice_observers.append(self.trace)
        self.sessions: CacheSessions | None = None  # named conversations and (persist_cache) the saved index
        if self.prefix_cache is not None:
            self.sessions = CacheSessions(self.prefix_cache, self.blocks, self.levels,
                                          self.placement, self._computed_digest,
                                          self._prefix_store(), cfg.block_size)
        # The level every replica shares (remote_kv_url), after the local ones; None = off.
        self.shared: SharedLevel | None = (shared_level_for(cfg) if self.prefix_cache is not None
                                           else None)
        self.importing = False  # blocks being installed from it (not published back)
        prefetch = build_prefetch(cfg, self.levels)
        self.prefetcher: Prefetcher | None = None
        self.device_staging: DeviceStaging | None = prefetch.device_staging
        self.reader.use_per_head_source(Level.HOST, self.device_staging)
        self.use_prefetcher(prefetch.prefetcher)

    def _cached_slots(self) -> dict[int, int]:
        """The slots unused cached blocks may keep on L1 and on the level below it
        (prefix_cache_host_bytes, prefix_cache_disk_bytes); the levels after those keep what their
        size allows."""
        budgets = (self.cfg.prefix_cache_host_bytes, self.cfg.prefix_cache_disk_bytes)
        return {level: nbytes // self.levels[level].bytes_per_slot
                for level, nbytes in zip((Level.HOST, Level.DISK), budgets)
                if level in self.levels}

    def _prefix_store(self) -> PrefixStore | None:
        """persist_cache: the index of the first level whose medium keeps its blocks across
        restarts."""
        persistent = [level for level, storage in self.levels.items()
                      if storage.persistence() is not None]
        if not (self.cfg.persist_cache and persistent):
            return None
        level = persistent[0]
        return PrefixStore.for_config(self.cfg, level, self.levels[level].num_slots)

    # ---- the levels, by their usual names ---------------------------------------------------------------------

    @property
    def device_pool(self) -> StorageLevel:
        return self.levels[Level.DEVICE]

    @property
    def host_pool(self) -> StorageLevel:
        return self.levels[Level.HOST]

    @property
    def disk_pool(self) -> StorageLevel | None:
        return self.levels.get(Level.DISK)

    def kv_capacity(self) -> KVCapacity:
        """Slots per level and the placement policy: what the scheduler checks a step against."""
        capacity = {level: alloc.num_slots for level, alloc in self.blocks.allocators.items()}
        return KVCapacity(self.policy, capacity, self.cfg.max_num_seqs, self.prefix_cache,
                          self.hierarchy)

    def use_prefetcher(self, prefetcher: Prefetcher | None) -> Prefetcher | None:
        """Swap the L2 prefetcher (None: read L2 on demand only); returns the previous one, still open."""
        previous = self.prefetcher
        if previous is not None:
            self.choice_observers.remove(previous)
        self.prefetcher = prefetcher
        if prefetcher is not None:
            self.choice_observers.append(prefetcher)
        through = prefetcher if prefetcher is not None and self.disk_pool is not None else None
        self.reader.use_read_through(Level.DISK, through)
        return previous

    def use_attention_backend(self, name: str) -> None:
        """Compute attention with the backend called `name` ("auto", "native", "torch")."""
        self.attention = select_backend(name, self.cfg)

    # ---- sequence lifecycle -----------------------------------------------------------------------------------

    def add_sequence(self, seq_id: int) -> None:
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id} already exists")
        row = self.rows.take()
        self.blocks.add_sequence(seq_id)
        self.seqs[seq_id] = SequenceKV(filling_row=row)

    def free_sequence(self, seq_id: int, keep_cached: bool = True) -> None:
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            return
        self.placement.release(seq_id, keep_cached)
        if self.locality is not None:
            self.locality.forget(seq_id)
        self.rows.give_back(seq.filling_row)
        if self.prefetcher is not None:
            self.prefetcher.forget(seq_id)

    def clear(self) -> None:
        """Free every sequence, then every cached block no saved session holds, on every level."""
        super().clear()
        for level, slot in self.blocks.drop_cached():
            self.levels[level].free(slot)

    def reuse_prefix(self, seq_id: int, token_ids: list[int], count: bool = True) -> int:
        """Give a new (empty) sequence the cached blocks of the longest prefix of `token_ids` they hold (not the last
        token; not past a block that lost its L1 master where the prefill after it reads FP16), brought up to the
        levels the policy wants; returns the number of tokens reused (their prefill is skipped)."""
        seq = self.seqs[seq_id]
        if self.prefix_cache is None or seq.num_tokens or not token_ids:
            return 0
        found = self.prefix_cache.match(token_ids, (len(token_ids) - 1) // self.cfg.block_size,
                                        count=count, needs_master=self.policy.keeps_master)
        for entry in found:
            self.blocks.share(seq_id, entry)
        for i, entry in enumerate(found):  # block by block, so a read that fails names its block
            try:
                self.placement.restore_block(seq_id, i)
                seq.record_digest(i, self._digest_of(entry))
            except ColdBlockError as error:  # the caller frees the sequence and computes it again without it
                self.prefix_cache.drop_bad(entry, error.reason)
                blame_sequence(error, seq_id)
                raise
        # Blocks with their FP16 master and a copy below read the one a fresh prefill would read
        # now.
        self.placement.place(seq_id)
        # The sink and newest reused blocks go into the row as a prefill would have left them (FP16, read there).
        sinks = min(len(found), self.rows.sink // self.cfg.block_size)
        recent = found[max(sinks, len(found) - self.rows.recent // self.cfg.block_size) :] if self.rows.recent else []
        self.rows.load(seq, self._blocks_kv(found[:sinks]), self._blocks_kv(recent))
        n = len(found) * self.cfg.block_size
        seq.num_tokens = n
        seq.token_ids = list(token_ids[:n])
        seq.last_block_name = found[-1].block_hash if found else 0
        return n

    def preload_prefix(self, token_ids: list[int],
                       should_stop: Callable[[], str | None] = lambda: None) -> PreloadResult:
        return preload_prefix(self, token_ids, should_stop)

    def import_shared_prefix(self, token_ids: list[int]) -> int:
        return import_shared_prefix(self, token_ids)

    def _digest_of(self, block: BlockEntry) -> torch.Tensor:
        """A cached block's key digest [num_layers, num_kv_heads, 2 * head_dim]: the one saved with it when it was
        recovered from a previous process, else computed from its most precise copy."""
        known = self.sessions.known_digest(block) if self.sessions is not None else None
        if known is not None:
            return known.to(self.cfg.device)
        return self._computed_digest(block)

    def _computed_digest(self, block: BlockEntry) -> torch.Tensor:
        return key_digest(self._blocks_kv([block])[0], self.cfg.digest_box_tokens)

    def _blocks_kv(self, blocks: list[BlockEntry]) -> torch.Tensor:
        """Blocks' keys and values side by side, [2, num_layers, num_kv_heads, len(blocks) * block_size, head_dim]
        (KV_DTYPE, on the cache's device), each from its most precise copy."""
        kv = [self.rows.arena.new_empty((2, self.cfg.num_layers, self.cfg.num_kv_heads, 0, self.cfg.head_dim))]
        for block in blocks:
            if block.kept_master_slot is not None:  # its FP16 master, kept while sequences read L2
                level, slot = Level.HOST, block.kept_master_slot
            else:
                level = self._precise_copy(block)
                slot = block.slots[level]
            kv.append(self.codecs[level].decode(self.levels[level].read_block(slot), KV_DTYPE))
        return torch.cat([t.to(self.cfg.device) for t in kv], dim=3)

    def _precise_copy(self, block: BlockEntry) -> int:
        """A block's most precise copy: the master (L1) among equals, then the fastest."""
        return max(block.slots, key=lambda lv: (self.codecs[lv].bits, lv == Level.HOST, -lv))

    def sequence_ids(self) -> list[int]:
        return list(self.seqs)

    def num_tokens(self, seq_id: int) -> int:
        return self.seqs[seq_id].num_tokens

    def max_decode_rows(self, seq_id: int) -> int:
        """To the end of the filling block: a decode step's reads change only when a block fills
        (the row keeps it or it leaves for L0, the window moves), so tokens within one block read,
        as decode steps, what those steps would read."""
        return self.cfg.block_size - self.seqs[seq_id].num_tokens % self.cfg.block_size

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Within the filling block only (its tokens are in the row alone; a full block has gone to
        the levels and the prefix cache)."""
        seq = self.seqs[seq_id]
        if seq.pending or not seq.num_tokens - seq.num_partial <= num_tokens <= seq.num_tokens:
            raise ValueError(f"sequence {seq_id}: cannot keep {num_tokens} of {seq.num_tokens} "
                             f"tokens (only the filling block's {seq.num_partial} can go, between "
                             "forwards)")
        seq.num_filling -= seq.num_tokens - num_tokens
        seq.num_tokens = num_tokens
        if seq.token_ids is not None:
            seq.token_ids = seq.token_ids[:num_tokens]
        seq.filling_decoded = seq.filling_decoded and seq.num_partial > 0

    def pin_span(self, seq_id: int, start: int, end: int) -> None:
        """Keep tokens [start, end) of the sequence in L0 whatever the window (e.g. a system prompt)."""
        seq = self.seqs[seq_id]
        seq.pinned_spans.append((start, end))
        table = self.blocks.tables[seq_id]
        for i in self.policy.span_blocks(start, end, len(table.blocks)):
            table.blocks[i].pinned = True
            if Level.DEVICE not in table.blocks[i].slots:
                self.placement.promote_to_device(seq_id, i)

    def demote_sequence(self, seq_id: int) -> int:
        """Drop the sequence's L0 copies (preemption under device pressure); see Placement.demote_sequence."""
        return self.placement.demote_sequence(seq_id)

    def promote_sequence(self, seq_id: int) -> int:
        """Restore the L0 copies the policy keeps; see Placement.promote_sequence."""
        return self.placement.promote_sequence(seq_id)

    # ---- attention --------------------------------------------------------------------------------------------

    def attend(self, layer: int, batch: ForwardBatch, q, k, v) -> torch.Tensor:
        """Every decode token of the forward in one backend call (a DecodeBatch); each prefill
        chunk on its own."""
        if len(batch.slices) == 1:  # whatever fails is this sequence's
            return self.attend_sequence(layer, batch.slices[0], q, k, v)
        decodes = [s for s in batch.slices if s.decoding]
        if len(decodes) == len(batch.slices):  # a decode step: the batch's tokens in slice order
            return self._attend_decodes(layer, decodes, q, k, v)
        out = torch.empty_like(q)
        for s in batch.slices:
            if not s.decoding:
                rows = slice(s.token_start, s.token_end)
                out[rows] = self.attend_sequence(layer, s, q[rows], k[rows], v[rows])
        if decodes:
            rows = torch.cat([torch.arange(s.token_start, s.token_end) for s in decodes])
            rows = rows.to(q.device)
            out[rows] = self._attend_decodes(layer, decodes, q[rows], k[rows], v[rows])
        return out

    def attend_sequence(self, layer: int, s: SequenceSlice, q, k, v) -> torch.Tensor:
        with serving_sequence(s.seq_id):  # the engine fails or recomputes this sequence only
            if s.decoding:
                return self._attend_decodes(layer, [s], q, k, v)
            seq, row, new_k, new_v = self.planner.begin(layer, s, q, k, v)
            reads = [LevelRead(level, plan, None) for level, plan in seq.plan.items()]
            return self.attention.prefill(layer, q, row, new_k, new_v, reads, self.reader)

    def _attend_decodes(self, layer: int, slices: list[SequenceSlice], q, k, v) -> torch.Tensor:
        # q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim]: the slices' tokens in
        # order
        batch = self.planner.decode_batch(layer, slices, q, k, v)
        return self.attention.decode_batch(batch, self.reader)

    def append_kv(self, seq_id: int, keys: torch.Tensor, values: torch.Tensor, token_ids: list[int]) -> None:
        """Restore exact KV [num_layers, num_kv_heads, n, head_dim] as a prefill chunk's forward would store it: the
        same commit, so every level gets its own copy, digest and placement (no attention, no prompt hints)."""
        seq = self.seqs[seq_id]
        if seq.pending:
            raise RuntimeError(f"sequence {seq_id} has a forward in flight")  # internal: restore between forwards
        seq.pending.extend(zip(keys.to(self.cfg.device, KV_DTYPE), values.to(self.cfg.device, KV_DTYPE)))
        self._commit_one(SequenceSlice(seq_id, 0, keys.shape[2], seq.num_tokens, tuple(token_ids)),
                         keys.shape[2])

    # ---- commit -----------------------------------------------------------------------------------------------

    def commit(self, batch: ForwardBatch, kept: Mapping[int, int] | None = None) -> None:
        for s in batch.slices:
            n = kept_tokens(s, kept)
            if n == 0:
                self._forget_pending(s.seq_id)
                continue
            try:
                self._commit_one(s, n)
            except Exception as e:
                blame_sequence(e, s.seq_id)
                raise
            if s.decoding:
                for observer in self.choice_observers:
                    observer.on_step_end(s.seq_id)

    def rollback(self, batch: ForwardBatch) -> None:
        for s in batch.slices:
            self._forget_pending(s.seq_id)

    def _forget_pending(self, seq_id: int) -> None:
        seq = self.seqs.get(seq_id)
        if seq is not None:
            seq.pending.clear()
            seq.plan = None
            for observer in self.choice_observers:
                observer.on_step_abort(seq_id)

    def _commit_one(self, s: SequenceSlice, n: int) -> None:
        """The first `n` of the slice's new tokens join the sequence."""
        seq = self.seqs[s.seq_id]
        seq.plan = None
        bs = self.cfg.block_size
        # Every token of the sequence after this commit, while all are known (they name full blocks).
        if seq.token_ids is not None:
            seq.token_ids = None if s.token_ids is None else seq.token_ids + list(s.token_ids[:n])
        new_k = torch.stack([pk[:, :n] for pk, _ in seq.pending])  # [L, heads, n, D]
        new_v = torch.stack([pv[:, :n] for _, pv in seq.pending])
        seq.pending.clear()
        done = self.rows.append(seq, new_k, new_v, len(self.blocks.tables[s.seq_id].blocks))
        # KV a decode step computed under approximate reads (INT4 window, selection) differs from what a prefill
        # of the same tokens computes (it reads FP16 copies): such blocks are not offered to the prefix cache, so a
        # reused prefix is what a fresh prefill would have written.
        decoded = s.decoding and self._approximate_decode
        for b in range(done.num_blocks):
            tainted = (b == 0 and seq.filling_decoded) or (decoded and (b + 1) * bs > done.old_partial)
            self._write_block(s.seq_id, done.full_k[:, :, b * bs : (b + 1) * bs],
                              done.full_v[:, :, b * bs : (b + 1) * bs], nameable=not tainted)
        seq.filling_decoded = seq.num_partial > 0 and (decoded or (done.num_blocks == 0 and seq.filling_decoded))
        seq.num_tokens += n
        self.placement.place(s.seq_id)

    def _write_block(self, seq_id: int, k: torch.Tensor, v: torch.Tensor, nameable: bool = True) -> None:
        """A block just filled: k, v [num_layers, num_kv_heads, block_size, head_dim] in KV_DTYPE; `nameable`:
        it may enter the prefix cache."""
        seq = self.seqs[seq_id]
        index = len(self.blocks.tables[seq_id].blocks)
        pinned = self.policy.is_pinned(index, seq.pinned_spans)
        self.placement.write_new_block(seq_id, k, v, pinned)
        # Digest for selection: per layer and KV head, the centre and radius of the block's key channels.
        seq.record_digest(index, key_digest(k, self.cfg.digest_box_tokens))  # [L, heads, boxes*2D]
        self._name_block(seq, seq_id, index, nameable)
        if self.shared is not None and nameable and not self.importing:
            entry = self.blocks.tables[seq_id].blocks[index]
            named = entry.block_hash is not None
            if named and self.prefix_cache.index.get(entry.block_hash) is entry:
                self.shared.publish(entry.block_hash, entry.token_ids, k, v)

    def _name_block(self, seq: SequenceKV, seq_id: int, index: int, register: bool = True) -> None:
        """Name a full block by its chain hash when its tokens are known; `register`: enter it in the prefix cache."""
        if self.prefix_cache is None or seq.token_ids is None:
            return
        bs = self.cfg.block_size
        tokens = tuple(seq.token_ids[index * bs : (index + 1) * bs])
        (name,) = chain_hashes(tokens, bs, self.prefix_cache.namespace, seq.last_block_name)
        seq.last_block_name = name
        if register:  # a cached copy of the same tokens that lost its master gives way to this one
            for level, slot in self.blocks.register(self.blocks.tables[seq_id].blocks[index], name, tokens):
                self.levels[level].free(slot)

    # ---- reporting --------------------------------------------------------------------------------------------

    def device_bytes_used(self) -> int:
        """Bytes of KV held in device memory now: L0 slots in use, the rows of live sequences (newest tokens FP16)
        and the L1 blocks staged on the device ahead of need."""
        row = self.rows.row_bytes
        cached = self.prefix_cache.unused_copies()[Level.DEVICE] if self.prefix_cache is not None else 0
        used = (self.blocks.allocators[Level.DEVICE].num_used - cached) * self.device_pool.bytes_per_slot
        ahead = self.device_staging.stats()["device_staging_bytes"] if self.device_staging is not None else 0
        return int(used + row * len(self.seqs) + ahead)

    def device_bytes_capacity(self) -> int:
        ahead = self.device_staging.area.numel() if self.device_staging is not None else 0
        return self.device_pool.capacity_bytes + self.rows.nbytes + ahead

    def kv_stats(self) -> KVStats:
        """One typed snapshot: every level in order, selection, moves and the parts the cache
        runs (kvcache/tiered_stats.py)."""
        return tiered_stats(self)

    # ---- sessions and persistence (kvcache/sessions.py) -------------------------------------------------------

    def save_session(self, name: str, token_ids: list[int]) -> int:
        """Keep the cached KV of a conversation's tokens under `name`; see CacheSessions.save."""
        return self._sessions().save(name, token_ids)

    def load_session(self, name: str) -> list[int] | None:
        return self._sessions().load(name)

    def delete_session(self, name: str) -> None:
        self._sessions().delete(name)

    def session_names(self) -> list[str]:
        return sorted(self.sessions.sessions) if self.sessions is not None else []

    def flush_cache(self) -> int:
        """persist_cache: write the cached blocks down and publish the index; see CacheSessions.flush."""
        return self.sessions.flush() if self.sessions is not None else 0

    def _sessions(self) -> CacheSessions:
        if self.sessions is None:
            raise SessionsUnavailableError(
                "named sessions need the prefix cache: set prefix_caching=True")
        return self.sessions

    def close(self) -> None:
        if self.shared is not None:
            self.shared.close()
        if self.sessions is not None:
            self.sessions.close()
        if self.prefetcher is not None:
            self.prefetcher.close()
        if self.device_staging is not None:
            self.device_staging.close()
        for level in self.levels.values():
            level.close()

