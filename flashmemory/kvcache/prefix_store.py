"""PrefixStore: the prefix cache across restarts (persist_cache). Next to the persistent level's
data (the L2 file: its medium's PersistentMedium, levels/protocol.py), an index names what each
slot holds (block name, tokens, key digest, the record's MAC) plus the saved sessions. It is
written atomically (a new owner-only temporary file, fsync, rename) after the L2 file is synced, at
a clean shutdown and when a session is saved, and authenticated with the cache's key
(prefix_index.py has the format).

At start-up the index is read back as untrusted input. One that cannot be believed as a whole
(unreadable, another format, a MAC that does not match, arrays that disagree) is discarded with
one log line and the cache starts empty; one of another namespace (model file, precision, block
size) discards its blocks but keeps its sessions' tokens. Each remaining entry must pass its own
checks, its slot's header must still name it, and its record must match its MAC (a record
rewritten with fresh CRCs is a miss, not garbage served); the rest become cached blocks on L2,
reused like any other. What was discarded is counted (`stats`) and logged in one line.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from flashmemory.kvcache.config import TieredCacheConfig
from flashmemory.kvcache.levels.protocol import PersistentMedium
from flashmemory.kvcache.levels.record_mac import TAG_BYTES
from flashmemory.kvcache.manager.blocks import BlockEntry, BlockManager, Level
from flashmemory.kvcache.manager.prefix_cache import PrefixCache
from flashmemory.kvcache.prefix_index import (INDEX_NAME, INDEX_VERSION, Entry, IndexGeometry,
                                              IndexRejected, read_index, valid_entries,
                                              valid_sessions, write_index)

logger = logging.getLogger(__name__)

TEMP_NAME = "kv-cache.index.tmp.npz"
__all__ = ["INDEX_NAME", "INDEX_VERSION", "PrefixStore", "Recovered"]


@dataclass
class Recovered:
    """What start-up found in the folder."""

    num_blocks: int = 0  # cached blocks back on L2
    discarded_namespace: bool = False  # the index belonged to another model / precision / block
    sessions: dict[str, list[int]] = field(default_factory=dict)


class PrefixStore:
    """Owns the index file of a persistent level: saving it, recovering the cache from it,
    and the counts of what recovery refused."""

    def __init__(self, folder: str | os.PathLike, namespace: bytes,
                 geometry: IndexGeometry, level: int = Level.DISK) -> None:
        self.path = Path(folder) / INDEX_NAME
        self.namespace = namespace
        self.geometry = geometry
        self.level = level  # the persistent level: the copies there are what the index names
        self.counters = {
            "persist_index_discarded": 0,  # index files not believed (the cache started empty)
            "persist_records_recovered": 0,  # blocks back on L2 from the previous process
            "persist_records_discarded_invalid": 0,  # entries that failed their own checks
            "persist_records_discarded_stale": 0,  # their slot no longer names them (rewritten)
            "persist_records_discarded_unauthenticated": 0,  # records not matching their MAC
            "persist_records_discarded_namespace": 0,  # written under other settings
            "persist_sessions_discarded": 0,  # saved sessions with a malformed name or token ids
        }

    @classmethod
    def for_config(cls, cfg: TieredCacheConfig, level: int, num_slots: int) -> PrefixStore:
        """The store of the persistent `level` (of `num_slots` slots)."""
        digest = (cfg.num_layers, cfg.num_kv_heads, cfg.digest_boxes * 2 * cfg.head_dim)
        assert cfg.cold_zone_dir is not None  # persist_cache needs one (engine/sizing.py)
        return cls(cfg.cold_zone_dir, cfg.prefix_namespace(),
                   IndexGeometry(cfg.block_size, digest, num_slots, cfg.vocab_size), level)

    def stats(self) -> dict[str, int]:
        return dict(self.counters)

    # ---- saving ------------------------------------------------------------------------------

    def save(self, prefix_cache: PrefixCache, disk: PersistentMedium,
             digests: dict[int, torch.Tensor], sessions: dict[str, list[int]]) -> int:
        """Index every named block with a copy on the persistent level (their digests from
        `digests`, by name); returns the count."""
        folder, signer, level = disk.folder, disk.signer, self.level
        entries = [e for e in prefix_cache.index.values() if level in e.slots
                   and e.token_ids is not None and disk.tag_of(e.slots[level])]
        disk.sync()  # the blocks reach the disk before an index that names them
        n = len(entries)
        digest_list = [digests[e.block_hash].to(torch.float16).cpu().numpy() for e in entries]
        arrays = {
            "version": np.array([INDEX_VERSION], dtype="<i8"),
            "namespace": np.frombuffer(self.namespace, dtype=np.uint8),
            "names": np.array([list(e.block_hash.to_bytes(16, "little")) for e in entries],
                              dtype=np.uint8).reshape(n, 16),
            "slots": np.array([e.slots[level] for e in entries], dtype="<i8"),
            "tokens": np.array([e.token_ids for e in entries],
                               dtype="<i4").reshape(n, prefix_cache.block_size),
            "digests": np.stack(digest_list) if n
            else np.zeros((0, *self.geometry.digest_shape), dtype="<f2"),
            "tags": np.array([list(disk.tag_of(e.slots[level])) for e in entries],
                             dtype=np.uint8).reshape(n, TAG_BYTES),
            "sessions": np.frombuffer(json.dumps(sessions).encode(), dtype=np.uint8),
        }
        fd = folder.create_temp(TEMP_NAME)
        with os.fdopen(fd, "wb") as f:
            write_index(f, arrays, signer)
            f.flush()
            os.fsync(f.fileno())
        folder.replace(TEMP_NAME, INDEX_NAME)  # atomic: the old index or the new, never half
        return n

    # ---- recovering --------------------------------------------------------------------------

    def load(self, prefix_cache: PrefixCache, blocks: BlockManager,
             disk: PersistentMedium) -> tuple[Recovered, dict]:
        """Recover the cached blocks the index names; returns what happened and their digests
        (name -> tensor)."""
        found = Recovered()
        arrays = self._read(disk)
        if arrays is None:
            return found, {}
        found.sessions, bad_sessions = valid_sessions(arrays["sessions"], self.geometry.vocab_size)
        self.counters["persist_sessions_discarded"] += bad_sessions
        if bad_sessions:
            logger.warning("%d saved session(s) in %s have a malformed name or token ids and are "
                           "discarded", bad_sessions, self.path.parent)
        if arrays["namespace"].tobytes() != self.namespace:
            # The blocks were computed under other settings; the sessions' token lists are what a
            # user saved, so they are kept and their KV is computed again when a prompt uses them.
            kept = (f"; the {len(found.sessions)} saved session(s) keep their tokens and are "
                    "recomputed when used") if found.sessions else ""
            logger.warning("discarding the %d cached blocks in %s: they belong to another model "
                           "file, KV precision, quantization range, block size or digest boxes%s",
                           len(arrays["slots"]), self.path.parent, kept)
            found.discarded_namespace = True
            self.counters["persist_records_discarded_namespace"] += len(arrays["slots"])
            return found, {}
        entries, invalid = valid_entries(arrays, self.geometry)
        digests = self._adopt(entries, prefix_cache, blocks, disk)
        found.num_blocks = len(digests)
        self.counters["persist_records_discarded_invalid"] += invalid
        self.counters["persist_records_recovered"] += found.num_blocks
        self._log_recovery(found.num_blocks)
        return found, digests

    def _read(self, disk: PersistentMedium) -> dict[str, np.ndarray] | None:
        """The index's arrays, or None (no index, or one discarded: logged once and counted)."""
        folder, signer = disk.folder, disk.signer
        try:
            fd = folder.open(INDEX_NAME, os.O_RDONLY)
        except FileNotFoundError:
            return None
        except OSError as e:  # a link (not followed), not a regular file, unreadable
            return self._discard(e.strerror or str(e))
        with os.fdopen(fd, "rb") as f:
            try:
                return read_index(f, os.fstat(fd).st_size, signer, self.geometry)
            except IndexRejected as e:
                return self._discard(e.reason)
            except OSError as e:
                return self._discard(f"it cannot be read: {e}")

    def _discard(self, reason: str) -> None:
        """Count and log an index not believed; returns None (nothing recovered)."""
        self.counters["persist_index_discarded"] += 1
        logger.warning(
            "discarding the prefix-cache index in %s (%s): the cache starts empty and is "
            "written again as prompts come", self.path.parent, reason)
        return None

    def _adopt(self, entries: list[Entry], prefix_cache: PrefixCache, blocks: BlockManager,
               disk: PersistentMedium) -> dict[int, torch.Tensor]:
        """Serve each entry whose slot still names it and whose record matches its MAC; returns
        their digests by name."""
        digests: dict[int, torch.Tensor] = {}
        taken: set[int] = set()
        for entry in sorted(entries, key=lambda e: e.slot):  # in file order: one pass
            left = disk.read_left(entry.slot)
            if left is None or left.name != entry.name:
                self.counters["persist_records_discarded_stale"] += 1
                continue
            if not disk.signer.record_ok(entry.slot, left.record, entry.tag):
                self.counters["persist_records_discarded_unauthenticated"] += 1
                continue
            block = BlockEntry(slots={self.level: entry.slot})
            if not prefix_cache.register(block, entry.name, entry.tokens):
                self.counters["persist_records_discarded_invalid"] += 1
                continue
            disk.adopt(entry.slot, left, entry.tag)
            taken.add(entry.slot)
            prefix_cache.release(block)
            digests[entry.name] = torch.from_numpy(entry.digest.astype(np.float32))
        blocks.allocators[self.level].take(taken)
        return digests

    def _log_recovery(self, num_blocks: int) -> None:
        """One line: what came back and what was discarded; a warning when an entry was malformed
        or a record changed since it was written (a slot rewritten after the index was saved is
        the normal end of a crash)."""
        c = self.counters
        dropped = {"malformed": c["persist_records_discarded_invalid"],
                   "not matching their MAC (changed since written)":
                       c["persist_records_discarded_unauthenticated"],
                   "whose slot holds something else": c["persist_records_discarded_stale"]}
        if not num_blocks and not any(dropped.values()):
            return
        detail = ", ".join(f"{n} {what}" for what, n in dropped.items() if n)
        suspicious = (c["persist_records_discarded_invalid"]
                      or c["persist_records_discarded_unauthenticated"])
        logger.log(logging.WARNING if suspicious else logging.INFO,
                   "prefix cache recovered from %s: %d blocks%s", self.path.parent, num_blocks,
                   f"; discarded, not served: {detail}" if detail else "")
