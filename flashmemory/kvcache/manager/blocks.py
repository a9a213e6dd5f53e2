"""Block bookkeeping for the KV hierarchy: levels, slot allocators, per-sequence block tables (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Protocol


class Level(IntEnum):
    """Where a copy of a block lives: a level is its position in the hierarchy (lower is faster and
    smaller; manager/hierarchy.py), and these name the first three. A level after them is a plain
    int."""

    DEVICE = 0  # L0 hot: device memory (a budgeted arena on a CPU-only host), INT4 by default
    HOST = 1  # L1 warm: host memory (pinned with CUDA), FP16
    DISK = 2  # L2 cold: one preallocated file, INT4 by default (INT2 with int2-disk)


def level_label(level: int) -> str:
    """The one name of a level in stats, metrics, logs and messages: L0, L1, ..."""
    return f"L{int(level)}"


def as_level(index: int) -> int:
    """A level's id: its position, as the Level member that names it for the first three."""
    return Level(index) if index < len(Level) else index


class SlotAllocator:
    """Owns the free list of one level's preallocated slots.

    NOTE: the most recently freed slot is reused first (a stack), so a quiet server keeps touching the same few
    slots: the memory and disk the OS commits stay at the working set instead of creeping over the whole pool.
    """

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # top of the stack last: slot 0 first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self) -> int | None:
        """A free slot, or None when the level is full (the caller demotes or reports)."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def take(self, slots: set[int]) -> None:
        """Mark specific free slots used (blocks recovered where a previous process left them)."""
        self._free = [s for s in self._free if s not in slots]
        self._used.update(slots)

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"slot {slot} is not allocated")  # internal bookkeeping bug, never user input
        self._used.remove(slot)
        self._free.append(slot)


@dataclass(eq=False)
class BlockEntry:
    """One block of KV: its copies by level (a block may have an L0 and an L1 copy at once), who uses it, and its
    name in the prefix cache once it is full and named."""

    slots: dict[Level, int] = field(default_factory=dict)
    pinned: bool = False  # kept in L0 regardless of the window (attention sinks, pinned spans)
    owners: set[int | str] = field(default_factory=set)  # sequences (and saved sessions) whose table holds it
    block_hash: int | None = None  # its chain hash (prefix_cache.py), None while unnamed
    token_ids: tuple[int, ...] | None = None  # its tokens, compared on every prefix hit
    payload: object = None  # what the data plane keeps with it (the key digest for selection)
    # Its L1 master copy (what a prefill writes) was dropped for a lossier one (INT2 on L2): any copy it has now,
    # an L1 copy decoded back included, is less precise than a fresh prefill's. Blocks read back from a previous
    # process's L2 file (persist_cache) are not marked: reusing their L2 copies is what that setting is for.
    master_lost: bool = False
    # Its L1 slot, kept for the prefix cache after the block aged onto a level below in a live
    # sequence (which reads that copy now): on release the block is cached with its FP16 master
    # again, so the same prompt once more reuses it instead of computing it again.
    kept_master_slot: int | None = None

    @property
    def primary(self) -> Level:
        """The fastest level holding a copy: the one attention reads."""
        return min(self.slots)


@dataclass
class BlockTable:
    """A sequence's logical blocks in token order; the last, still-filling block lives outside the table."""

    blocks: list[BlockEntry] = field(default_factory=list)

    def blocks_on(self, level: Level) -> list[int]:
        """Logical indices whose primary copy is on `level`."""
        return [i for i, b in enumerate(self.blocks) if b.slots and b.primary == level]

    def copies_on(self, level: Level) -> list[int]:
        """Logical indices that have a copy on `level` (primary or not)."""
        return [i for i, b in enumerate(self.blocks) if level in b.slots]


class NamedBlocks(Protocol):
    """What the block manager needs of the prefix cache (prefix_cache.PrefixCache)."""

    index: dict[int, BlockEntry]

    def release(self, entry: BlockEntry) -> None: ...

    def acquire(self, entry: BlockEntry) -> None: ...

    def evictable(self, level: Level) -> BlockEntry | None: ...

    def dropped_copy(self, entry: BlockEntry, level: Level) -> None: ...

    def forget(self, entry: BlockEntry) -> None: ...


class BlockManager:
    """Owns the slot allocators of every level, the block table of every sequence and (optionally) the prefix cache
    that keeps named blocks after their sequences end."""

    def __init__(self, num_slots: dict[Level, int], prefix_cache: NamedBlocks | None = None) -> None:
        self.allocators = {level: SlotAllocator(n) for level, n in num_slots.items()}
        self.tables: dict[int, BlockTable] = {}
        self.prefix_cache = prefix_cache
        # id -> block with a kept L1 slot, oldest first
        self.kept_masters: dict[int, BlockEntry] = {}

    def add_sequence(self, seq_id: int) -> BlockTable:
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} already exists")
        table = self.tables[seq_id] = BlockTable()
        return table

    def free_sequence(self, seq_id: int, keep_cached: bool = True) -> list[tuple[Level, int]]:
        """Drop the sequence; returns the (level, slot) pairs it released. A block another sequence still uses is
        kept; a named block nobody uses stays cached (its slots held until evicted) unless `keep_cached` is False,
        which also takes the sequence's blocks out of the prefix cache."""
        table = self.tables.pop(seq_id, None)
        if table is None:
            return []
        if not keep_cached and self.prefix_cache is not None:
            for block in table.blocks:
                self.prefix_cache.forget(block)
        return self._release_blocks(table.blocks, seq_id)

    def _release_blocks(self, blocks: list[BlockEntry], owner: int | str) -> list[tuple[Level, int]]:
        released = []
        # Newest first, so a prefix's tail is the least recently released and goes first when room is needed: a
        # prefix is reusable only up to its first missing block, so losing its head first would strand the rest.
        for block in reversed(blocks):
            block.owners.discard(owner)
            if block.owners:
                continue
            cache = self.prefix_cache
            if cache is not None and block.block_hash is not None and cache.index.get(block.block_hash) is block:
                released.extend(self.unkeep_master(block, into_slots=True))
                cache.release(block)
                continue
            released.extend(self.unkeep_master(block))
            for level, slot in block.slots.items():
                self.allocators[level].free(slot)
                released.append((level, slot))
            block.slots.clear()
        return released

    def keep_master(self, block: BlockEntry) -> None:
        """Take the block's L1 copy out of what its sequences read, holding the slot for the prefix
        cache (see BlockEntry.kept_master_slot)."""
        block.kept_master_slot = block.slots.pop(Level.HOST)
        self.kept_masters[id(block)] = block

    def unkeep_master(self, block: BlockEntry, into_slots: bool = False) -> list[tuple[Level, int]]:
        """End the block's kept L1 slot: back among its copies (`into_slots`, when it has no other
        L1 copy), else freed; returns the (level, slot) pairs freed."""
        slot = block.kept_master_slot
        if slot is None:
            return []
        block.kept_master_slot = None
        del self.kept_masters[id(block)]
        if into_slots and Level.HOST not in block.slots:
            block.slots[Level.HOST] = slot
            return []
        self.allocators[Level.HOST].free(slot)
        return [(Level.HOST, slot)]

    def oldest_kept_master(self) -> BlockEntry | None:
        return next(iter(self.kept_masters.values()), None)

    def share(self, seq_id: int, block: BlockEntry) -> int:
        """Append an existing (cached or shared) block to the sequence's table; returns its index."""
        table = self.tables[seq_id]
        table.blocks.append(block)
        block.owners.add(seq_id)
        if self.prefix_cache is not None:
            self.prefix_cache.acquire(block)
        return len(table.blocks) - 1

    def hold(self, owner: str, blocks: list[BlockEntry]) -> None:
        """Keep blocks from eviction on behalf of a saved session (an owner that is not a sequence)."""
        for block in blocks:
            block.owners.add(owner)
            if self.prefix_cache is not None:
                self.prefix_cache.acquire(block)

    def release_hold(self, owner: str, blocks: list[BlockEntry]) -> list[tuple[Level, int]]:
        """Undo `hold`; returns the (level, slot) pairs released."""
        return self._release_blocks(blocks, owner)

    def register(self, block: BlockEntry, name: int, token_ids: tuple[int, ...]) -> list[tuple[Level, int]]:
        """Name a freshly written full block in the prefix cache. An unused cached block of that name that lost its
        master copy gives way to it (the same tokens, precise again): returns the (level, slot) pairs it freed."""
        cache = self.prefix_cache
        if cache is None:
            return []
        old = cache.index.get(name)
        freed: list[tuple[Level, int]] = []
        if old is not None and old is not block and old.master_lost and not old.owners:
            freed = [(level, old.slots.pop(level)) for level in list(old.slots)]
            for level, slot in freed:
                self.allocators[level].free(slot)
            cache.forget(old)
        cache.register(block, name, token_ids)
        return freed

    def evict_cached(self, level: Level) -> list[tuple[Level, int]]:
        """Make room on `level` by dropping the copy of the least recently released unused named block there;
        returns the (level, slot) pairs freed (empty when no unused block has a copy on the level). A block left
        with only its L0 copy loses that too: an L0 copy is never a block's only copy."""
        cache = self.prefix_cache
        block = cache.evictable(level) if cache is not None else None
        if block is None:
            return []
        freed = [(level, block.slots.pop(level))]
        if set(block.slots) == {Level.DEVICE}:
            freed.append((Level.DEVICE, block.slots.pop(Level.DEVICE)))
        for lv, slot in freed:
            self.allocators[lv].free(slot)
            cache.dropped_copy(block, lv)
        return freed

    def drop_cached(self) -> list[tuple[Level, int]]:
        """Take every named block nobody uses out of the prefix cache, each copy on every level;
        returns the (level, slot) pairs freed. Blocks a sequence or a saved session holds stay."""
        cache = self.prefix_cache
        freed: list[tuple[Level, int]] = []
        for block in cache.unused_blocks() if cache is not None else []:
            for level, slot in block.slots.items():
                self.allocators[level].free(slot)
                freed.append((level, slot))
            block.slots.clear()
            cache.forget(block)
        return freed

    def allocate(self, level: Level) -> int | None:
        allocator = self.allocators.get(level)
        return None if allocator is None else allocator.allocate()

    def attach(self, seq_id: int, index: int, level: Level, slot: int) -> None:
        """Record that block `index` of the sequence now has a copy on `level` at `slot`."""
        block = self.tables[seq_id].blocks[index]
        if level in block.slots:
            raise ValueError(f"block {index} of sequence {seq_id} already has a copy on "
                             f"{level_label(level)}")
        block.slots[level] = slot

    def detach(self, seq_id: int, index: int, level: Level) -> int:
        """Drop the block's copy on `level` (its slot goes back to the free list); returns the slot."""
        block = self.tables[seq_id].blocks[index]
        slot = block.slots.pop(level)
        self.allocators[level].free(slot)
        return slot

    def append_block(self, seq_id: int, pinned: bool = False) -> int:
        table = self.tables[seq_id]
        table.blocks.append(BlockEntry(pinned=pinned, owners={seq_id}))
        return len(table.blocks) - 1

    def level_stats(self) -> dict[Level, dict[str, int]]:
        return {
            level: {"slots_total": a.num_slots, "slots_used": a.num_used, "slots_free": a.num_free}
            for level, a in self.allocators.items()
        }
