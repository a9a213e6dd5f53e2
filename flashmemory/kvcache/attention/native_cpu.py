"""NativeCpuAttention: decode through the compiled kernel — L0 and L1 blocks are read straight from their pools'
records (INT4 / FP16) into one online softmax; nothing is decoded into a float buffer first. A
decode batch is one kernel call for all its sequences (native/decode_batch.py). Prefill, and decode
steps the kernel cannot take (a query group above its limit, a dtype other than float32), use
TorchAttention."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from flashmemory.errors import serving_sequence
from flashmemory.kvcache import native
from flashmemory.kvcache.attention.backend import DecodeBatch, LevelRead, SequenceDecode
from flashmemory.kvcache.attention.torch_backend import TorchAttention
from flashmemory.kvcache.config import TieredCacheConfig
from flashmemory.kvcache.manager.blocks import Level

if TYPE_CHECKING:
    from flashmemory.kvcache.read.reader import BlockReader


class NativeCpuAttention:
    """Decode attention in the native CPU kernel; the torch backend for the rest."""

    name = "native"

    def __init__(self) -> None:
        self.fallback = TorchAttention()
        self._formats: dict[object, native.RecordFormat] = {}  # id(pool) (or a level without one) -> its format

    @staticmethod
    def supports(cfg: TieredCacheConfig) -> bool:
        """Whether decode steps of this geometry can use the kernel (CPU, float32 compute, within its limits)."""
        return native.supports(cfg.block_size, cfg.head_dim, cfg.device, torch.float32)

    def decode_batch(self, batch: DecodeBatch, reader: BlockReader) -> torch.Tensor:
        heads = reader.cfg.num_kv_heads
        if batch.q.dtype != torch.float32 or batch.q.shape[1] > native.MAX_GROUP * heads:
            return self.fallback.decode_batch(batch, reader)
        call = native.DecodeBatchCall(native.library(), heads)
        for seq in batch.seqs:
            with serving_sequence(seq.seq_id):
                self._add_sequence(call, batch.layer, seq, reader)
        return call.attend(batch.q)

    def _add_sequence(self, call: native.DecodeBatchCall, layer: int, seq: SequenceDecode,
                      reader: BlockReader) -> None:
        """The sequence's key sets, in order: its row (fp16 views, read in place), its new token,
        each level."""
        heads = seq.row.shape[1]
        call.next_sequence()
        call.add_dense(seq.row[0], seq.row[1])
        call.add_dense(seq.new_k, seq.new_v)
        for read in seq.reads:
            pool = reader.memory_pool(read.level)
            if (pool is None or read.level == Level.DISK) and read.chosen is not None:
                # read from a file as parts: laid out as records (still coded) and folded like a pool's
                records, positions = reader.records(read.level, read.plan, read.chosen, layer)
                call.add_records(records, positions, self._record_format(reader, read.level))
            elif pool is None or read.level == Level.DISK:  # every block of the level: decode, fold
                kv = reader.gather(read.level, read.plan, read.chosen, layer, torch.float32)
                call.add_dense(kv[0], kv[1])
            elif read.chosen is None:  # every head reads every block: one row of slots, read with a head stride of 0
                call.add_records(pool.storage, read.plan.slot_tensor.expand(heads, -1),
                                 self._format(pool), layer=layer)
            else:  # each head its chosen positions, looked up in the plan's slots by the kernel
                call.add_records(pool.storage, read.chosen, self._format(pool),
                                 table=read.plan.slot_tensor, layer=layer)

    def prefill(self, layer: int, q: torch.Tensor, filling: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor,
                reads: list[LevelRead], reader: BlockReader) -> torch.Tensor:
        return self.fallback.prefill(layer, q, filling, new_k, new_v, reads, reader)

    def _record_format(self, reader: BlockReader, level: Level) -> native.RecordFormat:
        """The format of `reader.records` for a level without a memory pool (its codec's record layout)."""
        key = ("records", level)
        fmt = self._formats.get(key)
        if fmt is None:
            codec = reader.codecs[level]
            layout = codec.record_layout(reader.cfg.block_size, reader.cfg.head_dim)
            fmt = self._formats[key] = native.RecordFormat.of(
                codec, reader.cfg.block_size, lambda part: layout[part][0] if part in layout else 0)
        return fmt

    def _format(self, pool) -> native.RecordFormat:
        fmt = self._formats.get(id(pool))
        if fmt is None:
            fmt = self._formats[id(pool)] = native.RecordFormat.for_pool(pool)
        return fmt
