"""TensorPool: a KV level in memory (L0 device arena, L1 host), preallocated slot storage for encoded blocks."""

from __future__ import annotations

import torch

from flashmemory.kvcache.levels import memory_lock
from flashmemory.kvcache.levels.protocol import Slots
from flashmemory.kvcache.manager.blocks import Level, level_label
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
        lock_memory: bool = False,
    ) -> None:
        self.level = level
        self.codec = codec
        self.num_slots = num_slots
        self.block_size = block_size
        self.device = device
        # name -> (byte offset in the record, byte size, shape without the lead dims, dtype)
        self.layout = codec.record_layout(block_size, head_dim)
        self.record_bytes = codec.nbytes((), block_size, head_dim)
        self.storage = torch.empty((num_layers, num_kv_heads, num_slots, self.record_bytes), dtype=torch.uint8,
                                   device=device, pin_memory=pin_memory)
        self.bytes_per_slot = num_layers * num_kv_heads * self.record_bytes
        self.segment_bytes = num_kv_heads * self.record_bytes
        # Bumped by put() before it writes a slot: a copy of a slot's bytes (device staging) is served only while
        # the slot's generation is the one the copy was issued under. On the CPU whatever the pool's device.
        self.generation = torch.zeros(num_slots, dtype=torch.int64)
        self.high_water_slots = 0  # slots ever written: the OS commits memory as they are touched
        # Locked in RAM (lock_host_memory): every page committed now and never swapped out.
        self.locked_bytes = 0
        if lock_memory and self.storage.numel():
            memory_lock.lock(self.storage.data_ptr(), self.storage.numel(),
                             f"the {level_label(level)} pool")
            self.locked_bytes = self.storage.numel()

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.bytes_per_slot

    def offset_of(self, part: str) -> int:
        """Byte offset of a codec part inside each record (0 for a part the codec does not have)."""
        return self.layout[part][0] if part in self.layout else 0

    def _parts(self, records: torch.Tensor) -> Parts:
        """Views of the parts inside records [..., record_bytes] -> {name: [..., *shape]}."""
        lead = records.shape[:-1]
        return {name: records[..., off : off + size].view(dtype).view(*lead, *shape)
                for name, (off, size, shape, dtype) in self.layout.items()}

    def put(self, slot: int, parts: Parts, name: int = 0) -> None:
        """Store an encoded block (parts shaped [num_layers, num_kv_heads, ...]) in `slot`."""
        self.generation[slot] += 1  # before the write: a copy racing with it is never served
        self.high_water_slots = max(self.high_water_slots, slot + 1)
        record = self.storage[:, :, slot]  # [L, heads, record_bytes]
        for name, tensor in parts.items():
            off, size, _, dtype = self.layout[name]
            raw = tensor.to(dtype).contiguous().view(torch.uint8).reshape(*record.shape[:2], size)
            record[..., off : off + size].copy_(raw, non_blocking=True)

    def free(self, slot: int) -> None:
        """Nothing to release in memory; the generation moves on so no earlier copy of the slot is served."""
        self.generation[slot] += 1

    def generation_of(self, slot: int) -> int:
        return int(self.generation[slot])

    def read_layer(self, slots: Slots, layer: int) -> Parts:
        return self.get_layer(torch.as_tensor(slots, dtype=torch.int64, device=self.device), layer)

    def read_block(self, slot: int) -> Parts:
        return self.get_block(slot)

    def read_segment(self, slot: int, layer: int, count_failures: bool = True) -> bytes:
        return self.storage[layer, :, slot].cpu().numpy().tobytes()

    def check_medium(self) -> None:
        """Memory cannot vanish under us."""

    def health(self) -> str | None:
        return None

    def parts_from_segments(self, data: bytes, n: int) -> Parts:
        records = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(n, self.storage.shape[1], -1)
        return self._parts(records.to(self.device))

    def persistence(self) -> None:
        """Memory does not outlive its process."""
        return None

    def counters(self) -> dict[str, int]:
        # Allocated lazily by the OS: the pages touched so far (slots are reused most-recently-freed
        # first); all of it when locked.
        committed = max(self.high_water_slots * self.bytes_per_slot, self.locked_bytes)
        return {"bytes_committed": committed}

    def close(self) -> None:
        """Memory is released with the pool (unlocked first, when it was locked)."""
        if self.locked_bytes:
            memory_lock.unlock(self.storage.data_ptr(), self.locked_bytes)
            self.locked_bytes = 0

    def get_layer(self, slots: torch.Tensor, layer: int) -> Parts:
        """Encoded parts of one layer for several slots (a long tensor on the pool's device): [heads, len(slots), ...]."""
        return self._parts(self.storage[layer].index_select(1, slots))

    def get_layer_per_head(self, slots: torch.Tensor, layer: int) -> Parts:
        """One layer, each KV head its own slots: slots [heads, n] (long, on the pool's device) -> [heads, n, ...]."""
        heads, n = slots.shape
        records, flat = self._per_head_rows(slots, layer)
        return self._parts(records.index_select(0, flat).view(heads, n, self.record_bytes))

    def _per_head_rows(self, slots: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's records as rows [heads * physical slots, record_bytes], and the rows of
        `slots` [heads, n] (each KV head its own), flattened."""
        heads = slots.shape[0]
        physical = self.storage.shape[2]  # the slots storage holds (fewer than num_slots in a shrunk DeviceArena)
        flat = (slots + torch.arange(heads, device=slots.device)[:, None] * physical).flatten()
        return self.storage[layer].view(heads * physical, self.record_bytes), flat

    def get_layer_keys_per_head(self, slots: torch.Tensor, layer: int) -> torch.Tensor:
        """The keys alone of an FP16 pool's blocks, each KV head its own slots: slots [heads, n] ->
        [heads, n, block_size, head_dim] fp16 (the values' bytes are not read)."""
        offset, size, (_, tokens, head_dim), dtype = self.layout["kv"]  # K then V
        heads, n = slots.shape
        records, flat = self._per_head_rows(slots, layer)
        keys = records[:, offset : offset + size // 2].index_select(0, flat)
        return keys.view(dtype).view(heads, n, tokens, head_dim)

    def key_records(self, layer: int) -> tuple[torch.Tensor, int, torch.dtype]:
        """A 16-bit pool's records of one layer in place, [heads, slots, record_bytes] uint8, the
        byte offset of each record's keys (block_size rows of head_dim values) and their dtype:
        what a kernel reads the keys from without gathering them."""
        offset, _, _, dtype = self.layout["kv"]  # K then V
        return self.storage[layer], offset, dtype

    def get_block(self, slot: int) -> Parts:
        """All layers of one slot: [num_layers, num_kv_heads, ...] (views)."""
        return self._parts(self.storage[:, :, slot])
