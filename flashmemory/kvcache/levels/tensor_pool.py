"""In-memory KV pools (L0 device arena, L1 host): preallocated slot storage for encoded blocks."""

from __future__ import annotations

import torch

from flashmemory.kvcache.manager.blocks import Level
from flashmemory.kvcache.native import RecordFormat
from flashmemory.kvcache.quant import Codec, Parts


class TensorPool:
    """Owns one level's preallocated storage: one byte tensor [num_layers, num_kv_heads, num_slots, record_bytes].

    A slot holds one block (block_size tokens) of every layer. The record of a (layer, KV head, slot) is the
    codec's parts back to back, so gathering one layer's blocks is a single index_select yielding
    [num_kv_heads, blocks, record_bytes], the layout attention wants, and the parts are views into it.
    Nothing is allocated after construction.
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
        self.device = device
        # name -> (byte offset in the record, byte size, shape without the lead dims, dtype)
        self.layout: dict[str, tuple[int, int, tuple[int, ...], torch.dtype]] = {}
        offset = 0
        for name, (shape, dtype) in codec.part_shapes((), block_size, head_dim).items():
            size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            self.layout[name] = (offset, size, shape, dtype)
            offset += size
        self.record_bytes = offset
        self.storage = torch.empty((num_layers, num_kv_heads, num_slots, offset), dtype=torch.uint8, device=device,
                                   pin_memory=pin_memory)
        self.bytes_per_slot = num_layers * num_kv_heads * offset
        # Bumped by put() before it writes a slot: a copy of a slot's bytes (device staging) is served only while
        # the slot's generation is the one the copy was issued under. On the CPU whatever the pool's device.
        self.generation = torch.zeros(num_slots, dtype=torch.int64)

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.bytes_per_slot

    @property
    def record_format(self) -> RecordFormat:
        """The record layout, for the decode kernel that reads blocks straight from storage."""
        offsets = {name: off for name, (off, *_) in self.layout.items()}
        c = self.codec
        if c.bits == 16:
            return RecordFormat(16, self.block_size, c.key_group_tokens, c.value_group_channels, offsets["kv"])
        return RecordFormat(c.bits, self.block_size, c.key_group_tokens, c.value_group_channels, offsets["codes"],
                            offsets["k_scale"], offsets["k_zero"], offsets["v_scale"], offsets["v_zero"])

    def _parts(self, records: torch.Tensor) -> Parts:
        """Views of the parts inside records [..., record_bytes] -> {name: [..., *shape]}."""
        lead = records.shape[:-1]
        return {name: records[..., off : off + size].view(dtype).view(*lead, *shape)
                for name, (off, size, shape, dtype) in self.layout.items()}

    def put(self, slot: int, parts: Parts) -> None:
        """Store an encoded block (parts shaped [num_layers, num_kv_heads, ...]) in `slot`."""
        self.generation[slot] += 1  # before the write: a copy racing with it is never served
        record = self.storage[:, :, slot]  # [L, heads, record_bytes]
        for name, tensor in parts.items():
            off, size, _, dtype = self.layout[name]
            raw = tensor.to(dtype).contiguous().view(torch.uint8).reshape(*record.shape[:2], size)
            record[..., off : off + size].copy_(raw, non_blocking=True)

    def get_layer(self, slots: torch.Tensor, layer: int) -> Parts:
        """Encoded parts of one layer for several slots (a long tensor on the pool's device): [heads, len(slots), ...]."""
        return self._parts(self.storage[layer].index_select(1, slots))

    def get_layer_per_head(self, slots: torch.Tensor, layer: int) -> Parts:
        """One layer, each KV head its own slots: slots [heads, n] (long, on the pool's device) -> [heads, n, ...]."""
        heads, n = slots.shape
        flat = (slots + torch.arange(heads, device=slots.device)[:, None] * self.num_slots).flatten()
        records = self.storage[layer].view(heads * self.num_slots, self.record_bytes).index_select(0, flat)
        return self._parts(records.view(heads, n, self.record_bytes))

    def get_block(self, slot: int) -> Parts:
        """All layers of one slot: [num_layers, num_kv_heads, ...] (views)."""
        return self._parts(self.storage[:, :, slot])
