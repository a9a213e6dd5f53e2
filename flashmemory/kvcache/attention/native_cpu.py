"""NativeCpuAttention: decode through the compiled kernel — L0 and L1 blocks are read straight from their pools'
records (INT4 / FP16) into one online softmax; nothing is decoded into a float buffer first. Prefill, and decode
steps the kernel cannot take (a query group above its limit, a dtype other than float32), use TorchAttention."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from flashmemory.kvcache import native
from flashmemory.kvcache.attention.backend import LevelRead
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
        self._formats: dict[int, native.RecordFormat] = {}  # id(pool) -> its record format

    @staticmethod
    def supports(cfg: TieredCacheConfig) -> bool:
        """Whether decode steps of this geometry can use the kernel (CPU, float32 compute, within its limits)."""
        return native.supports(cfg.block_size, cfg.head_dim, cfg.device, torch.float32)

    def decode(self, layer: int, q: torch.Tensor, filling: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor,
               reads: list[LevelRead], reader: BlockReader) -> torch.Tensor:
        heads = filling.shape[1]
        if q.dtype != torch.float32 or q.shape[1] > native.MAX_GROUP * heads:
            return self.fallback.decode(layer, q, filling, new_k, new_v, reads, reader)
        state = native.DecodeState(native.library(), q[0], heads)
        state.add_dense(torch.cat((filling[0], new_k), dim=1), torch.cat((filling[1], new_v), dim=1))
        for read in reads:
            pool = reader.memory_pool(read.level)
            if pool is None or read.level == Level.DISK:  # read from a file as parts, not records: decode, fold
                kv = reader.gather(read.level, read.plan, read.chosen, layer, torch.float32)
                state.add_dense(kv[0], kv[1])
                continue
            slots = read.plan.slot_tensor.expand(heads, -1) if read.chosen is None else read.plan.slot_tensor[read.chosen]
            state.add_records(pool.storage[layer], slots, self._format(pool))
        return state.output().unsqueeze(0)

    def prefill(self, layer: int, q: torch.Tensor, filling: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor,
                reads: list[LevelRead], reader: BlockReader) -> torch.Tensor:
        return self.fallback.prefill(layer, q, filling, new_k, new_v, reads, reader)

    def _format(self, pool) -> native.RecordFormat:
        fmt = self._formats.get(id(pool))
        if fmt is None:
            fmt = self._formats[id(pool)] = native.RecordFormat.for_pool(pool)
        return fmt
