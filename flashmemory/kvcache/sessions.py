"""CacheSessions: named conversations whose cached KV is kept from eviction, and (persist_cache) the prefix cache
written down to the persistent level (the L2 file) and its index at a clean shutdown, recovered by
the next process."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from flashmemory.errors import FlashMemoryError
from flashmemory.kvcache.levels.protocol import PersistentMedium, StorageLevel
from flashmemory.kvcache.manager.blocks import BlockEntry, BlockManager, Level
from flashmemory.kvcache.manager.prefix_cache import PrefixCache
from flashmemory.kvcache.placement import Placement
from flashmemory.kvcache.prefix_store import PrefixStore

logger = logging.getLogger(__name__)


class CacheSessions:
    """Owns the saved sessions (name -> tokens whose blocks are held), the digests of recovered blocks and the
    persistent index (when there is one)."""

    def __init__(self, prefix_cache: PrefixCache, blocks: BlockManager,
                 levels: dict[int, StorageLevel], placement: Placement,
                 digest_of: Callable[[BlockEntry], torch.Tensor], store: PrefixStore | None,
                 block_size: int) -> None:
        self.prefix_cache = prefix_cache
        self.blocks = blocks
        self.levels = levels
        self.placement = placement
        self.digest_of = digest_of  # computes a block's key digest from its copies
        self.store = store
        self.block_size = block_size
        self.sessions: dict[str, list[int]] = {}
        self._digests: dict[int, torch.Tensor] = {}  # by block name: recovered, or computed before a save
        if store is not None:
            self._recover()

    def known_digest(self, block: BlockEntry) -> torch.Tensor | None:
        return self._digests.get(block.block_hash) if block.block_hash is not None else None

    def save(self, name: str, token_ids: list[int]) -> int:
        """Hold the cached blocks of `token_ids` under `name` (never evicted until deleted; with persist_cache also
        written down, and the index published); returns the tokens whose KV is held (full blocks)."""
        self.delete(name)
        found = self.prefix_cache.match(token_ids, count=False)
        self.blocks.hold(_owner(name), found)
        self.sessions[name] = list(token_ids[: len(found) * self.block_size])
        if self.store is not None:
            self.flush()
        return len(self.sessions[name])

    def load(self, name: str) -> list[int] | None:
        """The tokens of a saved session (None if there is none by that name)."""
        return self.sessions.get(name)

    def delete(self, name: str) -> None:
        tokens = self.sessions.pop(name, None)
        if tokens is not None:
            for level, slot in self.blocks.release_hold(_owner(name), self.prefix_cache.match(tokens, count=False)):
                self.levels[level].free(slot)

    def flush(self) -> int:
        """Write every named block held only on faster levels down to the persistent one and
        publish the index; returns the blocks indexed (0 without a persistent level)."""
        if self.store is None:
            return 0
        level = self.store.level
        for entry in list(self.prefix_cache.index.values()):
            if entry.block_hash not in self._digests:
                self._digests[entry.block_hash] = self.digest_of(entry).to(torch.float16).cpu()
            if level not in entry.slots and any(Level.HOST <= lv < level for lv in entry.slots):
                try:
                    self.placement.write_copy(entry, level)
                except FlashMemoryError as e:
                    logger.warning(
                        "a cached block could not be written down (%s); it will be recomputed", e)
        return self.store.save(self.prefix_cache, self._persistent(), self._digests, self.sessions)

    def _persistent(self) -> PersistentMedium:
        assert self.store is not None
        medium = self.levels[self.store.level].persistence()
        assert medium is not None, "the store is made for a persistent level only"
        return medium

    def stats(self) -> dict[str, int]:
        """The persistent index's counters (what recovery refused); empty without persist_cache."""
        return self.store.stats() if self.store is not None else {}

    def close(self) -> None:
        if self.store is None:
            return
        try:
            indexed = self.flush()
            logger.info("prefix cache saved: %d blocks in %s", indexed, self.store.path.parent)
        except OSError as e:
            logger.error(
                "the prefix cache could not be saved (%s): the next start recomputes it", e)

    def _recover(self) -> None:
        assert self.store is not None
        found, self._digests = self.store.load(self.prefix_cache, self.blocks, self._persistent())
        for name, tokens in found.sessions.items():
            if found.discarded_namespace:  # no block of it is cached: keep its tokens, a prompt recomputes them
                self.sessions[name] = list(tokens)
                continue
            entries = self.prefix_cache.match(tokens, count=False)
            self.blocks.hold(_owner(name), entries)
            self.sessions[name] = list(tokens[: len(entries) * self.block_size])


def _owner(name: str) -> str:
    return f"session:{name}"
