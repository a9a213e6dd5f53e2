"""StorageLevel: what every KV level's storage medium offers (device/host memory, a disk file, later others).

A level is a preallocated set of slots; one slot holds one block (block_size tokens) of every layer, encoded by
the level's codec. The cache writes whole blocks (`put`), reads one layer of many blocks for attention
(`read_layer`) or every layer of one block for a move between levels (`read_block`), and gives slots back
(`free`). `generation_of` changes whenever a slot's bytes are about to change (rewritten or freed), so a copy
taken earlier (prefetch, device staging) can tell it went stale. The raw segment API (`read_segment`,
`parts_from_segments`) lets a read-ahead layer keep verified bytes of one (slot, layer) without knowing the medium.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from flashmemory.kvcache.manager.blocks import Level
from flashmemory.kvcache.quant import Codec, Parts

Slots = torch.Tensor | Sequence[int]  # slot numbers: an int64 tensor, or a list of ints


@runtime_checkable
class StorageLevel(Protocol):
    """One KV level's slots on one medium."""

    level: Level
    codec: Codec
    num_slots: int
    bytes_per_slot: int  # encoded bytes of one block, every layer and KV head
    segment_bytes: int  # encoded bytes of one layer of one block (every KV head)

    @property
    def capacity_bytes(self) -> int: ...

    def put(self, slot: int, parts: Parts, name: int = 0) -> None:
        """Store an encoded block (parts shaped [num_layers, num_kv_heads, ...]) in `slot`; `name` is its prefix-cache
        name (a medium that outlives the process records it, so a later process can tell what the slot holds)."""

    def read_layer(self, slots: Slots, layer: int) -> Parts:
        """One layer of several blocks: parts [num_kv_heads, len(slots), ...]."""

    def read_block(self, slot: int) -> Parts:
        """Every layer of one block: parts [num_layers, num_kv_heads, ...]."""

    def free(self, slot: int) -> None:
        """The slot no longer holds a block (its generation moves on)."""

    def generation_of(self, slot: int) -> int:
        """A number that changes before the slot's bytes change."""

    def read_segment(self, slot: int, layer: int, count_failures: bool = True) -> bytes:
        """One layer of one block as verified raw bytes (a corrupt or missing block raises ColdBlockError, counted
        unless `count_failures` is False: a read-ahead that lost a race with a rewrite is not a fault)."""

    def check_medium(self) -> None:
        """Raise ColdBlockError when the medium itself is gone (e.g. the file was deleted)."""

    def health(self) -> str | None:
        """Why the level is not as it should be (a sentence naming no file: /health shows it), or
        None."""

    def parts_from_segments(self, data: bytes, n: int) -> Parts:
        """n segments back to back -> parts [n, num_kv_heads, ...]."""

    def counters(self) -> dict[str, int]:
        """The medium's own counters for stats (e.g. bytes read, load failures by reason); may be empty."""

    def close(self) -> None:
        """Release the medium (files are removed)."""
