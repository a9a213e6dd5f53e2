"""In-memory KV pools (L0 device arena, L1 host): preallocated slot storage for encoded blocks."""

from __future__ import annotations

import torch

from flashmemory.kvcache.blocks import Level
from flashmemory.kvcache.quant import Codec, Parts


class TensorPool:
    """Owns one level's preallocated storage: per codec part, a tensor [num_layers, num_kv_heads, num_slots, ...].

    A slot holds one block (block_size tokens) of every layer. Layer- then head-major, so gathering one layer's
    blocks yields [num_kv_heads, blocks, ...], the layout attention wants. Nothing is allocated after construction.
    """

    def __init__(
        self,
        level: Level,
        codec: Codec,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        block_size: int,
        head_dim: int,
        device: torch.device,
        pin_memory: bool = False,
    ) -> None:
        self.level = level
        self.codec = codec
        self.num_slots = num_slots
        self.block_size = block_size
        shapes = codec.part_shapes((num_kv_heads,), block_size, head_dim)
        self.device = device
        self.storage: dict[str, torch.Tensor] = {
            name: torch.empty((num_layers, shape[0], num_slots, *shape[1:]), dtype=dtype, device=device,
                              pin_memory=pin_memory)
            for name, (shape, dtype) in shapes.items()
        }
        self.bytes_per_slot = codec.nbytes((num_layers, num_kv_heads), block_size, head_dim)

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.bytes_per_slot

    def put(self, slot: int, parts: Parts) -> None:
        """Store an encoded block (parts shaped [num_layers, num_kv_heads, ...]) in `slot`."""
        for name, tensor in parts.items():
            self.storage[name][:, :, slot].copy_(tensor, non_blocking=True)

    def get_layer(self, slots: torch.Tensor, layer: int) -> Parts:
        """Encoded parts of one layer for several slots (a long tensor on the pool's device): [heads, len(slots), ...]."""
        return {name: t[layer].index_select(1, slots) for name, t in self.storage.items()}

    def get_block(self, slot: int) -> Parts:
        """All layers of one slot: [num_layers, num_kv_heads, ...] (views)."""
        return {name: t[:, :, slot] for name, t in self.storage.items()}
