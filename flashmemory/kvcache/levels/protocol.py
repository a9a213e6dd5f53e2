"""StorageLevel: what every KV level's storage medium offers (device/host memory, a disk file, later others).

A level is a preallocated set of slots; one slot holds one block (block_size tokens) of every layer, encoded by
the level's codec. The cache writes whole blocks (`put`), reads one layer of many blocks for attention
(`read_layer`) or every layer of one block for a move between levels (`read_block`), and gives slots back
(`free`). `generation_of` changes whenever a slot's bytes are about to change (rewritten or freed), so a copy
taken earlier (prefetch, device staging) can tell it went stale. The raw segment API (`read_segment`,
`parts_from_segments`) lets a read-ahead layer keep verified bytes of one (slot, layer) without knowing the medium.
A medium that can outlive its process (the disk file with persist_cache) offers a PersistentMedium
through `persistence()`: what the prefix index (prefix_store.py) needs to save and recover its
blocks; every other medium answers None, and persist_cache then has nothing to keep.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from flashmemory.kvcache.levels.cache_folder import CacheFolder
from flashmemory.kvcache.levels.record_mac import RecordSigner
from flashmemory.kvcache.quant import Codec, Parts

Slots = torch.Tensor | Sequence[int]  # slot numbers: an int64 tensor, or a list of ints


@dataclass(frozen=True)
class LeftRecord:
    """What a previous process left in one slot: the block name and checksums its header gives, and
    the record's bytes as stored (for the MAC check)."""

    name: int
    crcs: list[int]
    record: bytes


class PersistentMedium(Protocol):
    """What a level that outlives its process offers the prefix index (kvcache/prefix_store.py)."""

    folder: CacheFolder  # the checked folder the level's data and its index live in
    signer: RecordSigner  # the cache's MAC key: records and the index are trusted through it

    def tag_of(self, slot: int) -> bytes | None:
        """The MAC of the record in `slot` (None: it holds none)."""

    def sync(self) -> None:
        """Make every block written so far durable (before an index that names them is
        published)."""

    def read_left(self, slot: int) -> LeftRecord | None:
        """What a previous process left in `slot`; None where no valid header is (format, shape,
        model)."""

    def adopt(self, slot: int, left: LeftRecord, tag: bytes) -> None:
        """Serve the block `left` describes from `slot` (its MAC `tag` checked by the caller)."""


@runtime_checkable
class StorageLevel(Protocol):
    """One KV level's slots on one medium."""

    level: int  # its position in the hierarchy (manager/hierarchy.py)
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

    def persistence(self) -> PersistentMedium | None:
        """What keeps this level's blocks across restarts; None: the medium does not (memory,
        scratch)."""

    def counters(self) -> dict[str, int]:
        """The medium's own counters for stats (e.g. bytes read, load failures by reason); may be empty."""

    def close(self) -> None:
        """Release the medium (files are removed)."""
