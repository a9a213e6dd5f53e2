"""DictStore: a stand-in for a remote key-value store as a KV level (each block's layer kept as
bytes under its key), written against the StorageLevel protocol alone: what a new medium is, in one
file."""

from __future__ import annotations

import numpy as np
import torch

from flashmemory.errors import ColdBlockError
from flashmemory.kvcache.config import TieredCacheConfig
from flashmemory.kvcache.levels.protocol import Slots
from flashmemory.kvcache.quant import Codec, Parts

MEDIUM = "dict_store"


class DictStore:
    """Owns a dict of (slot, layer) -> the codec's parts of that layer back to back, like a remote
    store's keys."""

    def __init__(self, level: int, codec: Codec, num_slots: int, cfg: TieredCacheConfig) -> None:
        self.level = level
        self.codec = codec
        self.num_slots = num_slots
        self.num_layers = cfg.num_layers
        self.part_shapes = codec.part_shapes((cfg.num_kv_heads,), cfg.block_size, cfg.head_dim)
        self.segment_bytes = codec.nbytes((cfg.num_kv_heads,), cfg.block_size, cfg.head_dim)
        self.bytes_per_slot = cfg.num_layers * self.segment_bytes
        self.values: dict[tuple[int, int], bytes] = {}
        self.generations: dict[int, int] = {}
        self.bytes_read = 0

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.bytes_per_slot

    def put(self, slot: int, parts: Parts, name: int = 0) -> None:
        self.generations[slot] = self.generations.get(slot, 0) + 1
        for layer in range(self.num_layers):
            self.values[slot, layer] = b"".join(
                parts[p][layer].contiguous().cpu().numpy().tobytes() for p in self.part_shapes)

    def read_segment(self, slot: int, layer: int, count_failures: bool = True) -> bytes:
        data = self.values.get((slot, layer))
        if data is None:
            raise ColdBlockError(f"the store holds no block in slot {slot}", reason="missing")
        self.bytes_read += len(data)
        return data

    def parts_from_segments(self, data: bytes, n: int) -> Parts:
        buf = np.frombuffer(bytearray(data), dtype=np.uint8).reshape(n, self.segment_bytes)
        parts, offset = {}, 0
        for name, (shape, dtype) in self.part_shapes.items():
            size = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
            raw = np.ascontiguousarray(buf[:, offset: offset + size])
            parts[name] = torch.from_numpy(raw).view(dtype).reshape(n, *shape)
            offset += size
        return parts

    def read_layer(self, slots: Slots, layer: int) -> Parts:
        slots = slots.tolist() if isinstance(slots, torch.Tensor) else list(slots)
        data = b"".join(self.read_segment(slot, layer) for slot in slots)
        parts = self.parts_from_segments(data, len(slots))  # [n, heads, ...]
        return {name: t.transpose(0, 1) for name, t in parts.items()}

    def read_block(self, slot: int) -> Parts:
        data = b"".join(self.read_segment(slot, layer) for layer in range(self.num_layers))
        return self.parts_from_segments(data, self.num_layers)

    def free(self, slot: int) -> None:
        self.generations[slot] = self.generations.get(slot, 0) + 1
        for layer in range(self.num_layers):
            self.values.pop((slot, layer), None)

    def generation_of(self, slot: int) -> int:
        return self.generations.get(slot, 0)

    def check_medium(self) -> None:
        """A dict cannot vanish."""

    def health(self) -> str | None:
        return None

    def persistence(self) -> None:
        return None  # forgotten with the process: persist_cache keeps nothing here

    def counters(self) -> dict[str, int]:
        return {"bytes_read": self.bytes_read}

    def close(self) -> None:
        self.values.clear()


def dict_store(level: int, codec: Codec, num_slots: int, cfg: TieredCacheConfig) -> DictStore:
    """The registry line's factory (kvcache/levels/registry.py's MEDIA signature)."""
    return DictStore(level, codec, num_slots, cfg)


def register(monkeypatch) -> None:
    """The one registry line, for this test only."""
    from flashmemory.kvcache.levels import registry

    monkeypatch.setitem(registry.MEDIA, MEDIUM, dict_store)
