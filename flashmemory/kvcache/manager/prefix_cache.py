"""PrefixCache: full blocks named by their content, so a new sequence reuses the KV of any prefix already computed
(vLLM's automatic prefix caching, over every level of the hierarchy). No torch.

Block i of a sequence is named by a chain hash of (the name of block i - 1, its token ids, and a namespace: model,
KV precision of every level, block size), so equal names mean equal prefixes. The index maps names to blocks; a
block that no sequence (or saved session) uses any more stays cached until its slots are needed: `evictable` hands
out the least recently released one with a copy on a given level. As nano-vllm does, a hit compares the stored
token ids too, so a hash collision can never serve the wrong KV.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence

from flashmemory.kvcache.manager.blocks import BlockEntry, Level
from flashmemory.kvcache.manager.hierarchy import as_level, level_label

HASH_BYTES = 16


def chain_hashes(token_ids: Sequence[int], block_size: int, namespace: bytes, start_hash: int = 0,
                 start_block: int = 0) -> list[int]:
    """Names of the full blocks of `token_ids` from block `start_block` on (the name of the block before it is
    `start_hash`; 0 before the first block)."""
    out = []
    prev = start_hash
    for b in range(start_block, len(token_ids) // block_size):
        tokens = array("i", token_ids[b * block_size : (b + 1) * block_size]).tobytes()
        digest = hashlib.blake2b(prev.to_bytes(HASH_BYTES, "little") + tokens, digest_size=HASH_BYTES,
                                 key=namespace[:64]).digest()
        prev = int.from_bytes(digest, "little")
        out.append(prev)
    return out


class PrefixCache:
    """Owns the index of named blocks, the LRU of unused ones, and the hit / eviction counters."""

    def __init__(self, block_size: int, namespace: bytes, num_levels: int = len(Level)) -> None:
        self.block_size = block_size
        self.namespace = namespace  # model fingerprint, precision per level, block size (see TieredKVCache)
        self.levels = tuple(as_level(i) for i in range(num_levels))  # the hierarchy's, in order
        self.index: dict[int, BlockEntry] = {}
        self._unused: OrderedDict[int, BlockEntry] = OrderedDict()  # name -> block, least recently released first
        self.queried_tokens = 0
        self.hit_tokens = 0
        # Reused blocks by the level of their fastest copy; copies dropped to make room, by level.
        self.hit_blocks = {level: 0 for level in self.levels}
        self.evicted_blocks = {level: 0 for level in self.levels}
        self.lossy_refusals = 0  # matches cut short at a block whose L1 master was lost (see match)
        self.bad_blocks: Counter[str] = Counter()  # blocks dropped because a reuse could not read them, by reason

    def __len__(self) -> int:
        return len(self.index)

    @property
    def num_unused(self) -> int:
        return len(self._unused)

    @property
    def hit_rate(self) -> float:
        """Tokens found over tokens looked up, since the cache started."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def match(self, token_ids: Sequence[int], max_blocks: int | None = None, count: bool = True,
              needs_master: Callable[[int, int], bool] | None = None) -> list[BlockEntry]:
        """The blocks of the longest cached prefix of `token_ids` (at most `max_blocks`), in order.

        needs_master(i, n): whether block i keeps its L1 master copy (FP16) in a sequence of n full blocks. With it,
        the prefix ends before any block whose master was lost (`BlockEntry.master_lost`: INT2 is all it keeps)
        that the prefill after the prefix would read in FP16 had it computed everything: reuse is then never less
        precise than computing again (up to where the prefill splits its chunks)."""
        limit = len(token_ids) // self.block_size if max_blocks is None else max_blocks
        found: list[BlockEntry] = []
        prev = 0
        for b in range(limit):
            tokens = tuple(token_ids[b * self.block_size : (b + 1) * self.block_size])
            (name,) = chain_hashes(tokens, self.block_size, self.namespace, prev)
            entry = self.index.get(name)
            if entry is None or entry.token_ids != tokens or not entry.slots:
                break
            found.append(entry)
            prev = name
        if needs_master is not None:
            found = self._precise_prefix(found, needs_master, count)
        if count:
            self.queried_tokens += len(token_ids)
            self.hit_tokens += len(found) * self.block_size
            for entry in found:
                self.hit_blocks[entry.primary] += 1
        return found

    def _precise_prefix(self, found: list[BlockEntry], needs_master: Callable[[int, int], bool],
                        count: bool) -> list[BlockEntry]:
        """The longest head of `found` after which no block the prefill needs in FP16 lost its master. A shorter
        head starts the prefill earlier, where older blocks may be needed in FP16, so one pass from the newest block
        down checks each block against the end in force when it is reached."""
        end = len(found)
        for i in range(end - 1, -1, -1):
            if found[i].master_lost and needs_master(i, end):
                end = i
        self.lossy_refusals += count and end < len(found)
        return found[:end]

    def register(self, entry: BlockEntry, name: int, token_ids: tuple[int, ...]) -> bool:
        """Name a freshly written full block; False (and nothing changes) when another block already has the
        name (two sequences computed the same prefix at once: the second copy stays private)."""
        if name in self.index:
            return False
        entry.block_hash, entry.token_ids = name, token_ids
        self.index[name] = entry
        return True

    def release(self, entry: BlockEntry) -> None:
        """Nobody uses the named block any more: it stays cached, first in line for eviction among the newest."""
        if entry.block_hash is not None and self.index.get(entry.block_hash) is entry:
            self._unused[entry.block_hash] = entry
            self._unused.move_to_end(entry.block_hash)

    def acquire(self, entry: BlockEntry) -> None:
        """A sequence uses the block again: it cannot be evicted while it does."""
        if entry.block_hash is not None:
            self._unused.pop(entry.block_hash, None)

    def unused_blocks(self) -> list[BlockEntry]:
        """Blocks nobody uses, least recently released first."""
        return list(self._unused.values())

    def unused_copies(self) -> dict[Level, int]:
        """Copies per level held by blocks nobody uses: slots that are cached, and free for the taking."""
        out = {level: 0 for level in self.levels}
        for entry in self._unused.values():
            for level in entry.slots:
                out[level] += 1
        return out

    def evictable(self, level: Level) -> BlockEntry | None:
        """The least recently released unused block with a copy on `level`, or None."""
        for entry in self._unused.values():
            if level in entry.slots:
                return entry
        return None

    def dropped_copy(self, entry: BlockEntry, level: Level) -> None:
        """Record an evicted copy; a block with no copy left leaves the index."""
        self.evicted_blocks[level] += 1
        if not entry.slots:
            self.forget(entry)

    def forget(self, entry: BlockEntry) -> None:
        if entry.block_hash is not None:
            if self.index.get(entry.block_hash) is entry:
                del self.index[entry.block_hash]
            self._unused.pop(entry.block_hash, None)

    def drop_bad(self, entry: BlockEntry, reason: str) -> None:
        """A reuse could not read the block (a corrupt or lost cold record, `reason` as ColdBlockError's): it leaves
        the index, so no later prefix match finds it; its slots go back when its last user lets go."""
        self.forget(entry)
        self.bad_blocks[reason] += 1

    def stats(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {
            "prefix_cache_queries": self.queried_tokens,  # tokens looked up (vLLM's prefix_cache_queries)
            "prefix_cache_hits": self.hit_tokens,  # tokens found
            "prefix_cache_hit_rate": self.hit_rate,
            "prefix_cache_blocks": len(self.index),
            "prefix_cache_unused_blocks": len(self._unused),
            "prefix_cache_lossy_refusals": self.lossy_refusals,  # reuses cut short at a block only left lossy
            "prefix_cache_bad_blocks": sum(self.bad_blocks.values()),  # dropped: a reuse could not read them
        }
        for reason, n in sorted(self.bad_blocks.items()):
            out[f"prefix_cache_bad_blocks_{reason}"] = n
        for level in self.levels:
            out[f"{level_label(level)}_prefix_hit_blocks"] = self.hit_blocks[level]
            out[f"{level_label(level)}_prefix_evicted_blocks"] = self.evicted_blocks[level]
        return out
