"""PrefixStore: the prefix cache across restarts (persist_cache). Next to the persistent L2 file, an index names
what each slot holds (block name, tokens, key digest) plus the saved sessions; it is written atomically (a temporary
file, fsync, rename) after the L2 file is synced, at a clean shutdown and when a session is saved. At start-up the
index is read back: entries of another namespace (model file, precision, block size) are discarded with one log
line; an entry whose slot no longer says it holds that block (rewritten, torn, corrupt header) is dropped; the rest
become cached blocks on L2, reused like any other (a corrupt payload is still caught by its checksum on read)."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from flashmemory.kvcache.levels.disk_pool import DiskPool
from flashmemory.kvcache.manager.blocks import BlockEntry, BlockManager, Level
from flashmemory.kvcache.manager.prefix_cache import PrefixCache

log = logging.getLogger(__name__)

INDEX_NAME = "kv-cache.index.npz"
INDEX_VERSION = 1


@dataclass
class Recovered:
    """What start-up found in the folder."""

    num_blocks: int = 0  # cached blocks back on L2
    num_dropped: int = 0  # entries whose slot no longer holds them
    discarded_namespace: bool = False  # the whole index belonged to another model / precision / block size
    sessions: dict[str, list[int]] | None = None


class PrefixStore:
    """Owns the index file of a persistent cold zone: saving it, and recovering the cache from it."""

    def __init__(self, folder: str | os.PathLike, namespace: bytes) -> None:
        self.path = Path(folder) / INDEX_NAME
        self.namespace = namespace

    def save(self, prefix_cache: PrefixCache, disk: DiskPool, digests: dict[int, torch.Tensor],
             sessions: dict[str, list[int]]) -> int:
        """Index every named block with a copy on L2 (their digests from `digests`, by name); returns the count."""
        entries = [e for e in prefix_cache.index.values() if Level.DISK in e.slots and e.token_ids is not None]
        disk.sync()  # the blocks reach the disk before an index that names them
        names = np.array([list(e.block_hash.to_bytes(16, "little")) for e in entries], dtype=np.uint8).reshape(-1, 16)
        slots = np.array([e.slots[Level.DISK] for e in entries], dtype=np.int64)
        tokens = np.array([e.token_ids for e in entries], dtype=np.int32).reshape(len(entries), prefix_cache.block_size)
        stacked = [digests[e.block_hash].to(torch.float16).cpu().numpy() for e in entries]
        digest_array = np.stack(stacked) if stacked else np.zeros((0,), dtype=np.float16)
        tmp = self.path.with_suffix(".tmp.npz")
        with open(tmp, "wb") as f:
            np.savez(f, version=np.array([INDEX_VERSION]), namespace=np.frombuffer(self.namespace, dtype=np.uint8),
                     names=names, slots=slots, tokens=tokens, digests=digest_array,
                     sessions=np.frombuffer(json.dumps(sessions).encode(), dtype=np.uint8))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)  # atomic: a reader sees the old index or the new one, never half of one
        return len(entries)

    def load(self, prefix_cache: PrefixCache, blocks: BlockManager, disk: DiskPool) -> tuple[Recovered, dict]:
        """Recover the cached blocks the index names; returns what happened and their digests (name -> tensor)."""
        found = Recovered(sessions={})
        if not self.path.exists():
            return found, {}
        try:
            with np.load(self.path) as data:
                index = {key: data[key] for key in data.files}
        except (OSError, ValueError, KeyError) as e:
            log.warning("the prefix-cache index %s cannot be read (%s); starting with an empty cache", self.path, e)
            return found, {}
        if int(index["version"][0]) != INDEX_VERSION or bytes(index["namespace"]) != self.namespace:
            # The blocks were computed under other settings; the sessions' token lists are what a user saved, so
            # they are kept (same index version) and their KV is computed again when a prompt uses them.
            same_version = int(index["version"][0]) == INDEX_VERSION
            found.sessions = json.loads(bytes(index["sessions"]).decode() or "{}") if same_version else {}
            log.warning("discarding the %d cached blocks in %s: they belong to another model file, KV precision, "
                        "quantization range, block size or digest boxes%s", len(index["slots"]), self.path.parent,
                        f"; the {len(found.sessions)} saved session(s) keep their tokens and are recomputed when "
                        "used" if found.sessions else "")
            found.discarded_namespace = True
            return found, {}
        digests = {}
        taken: set[int] = set()
        for i, slot in enumerate(index["slots"].tolist()):
            name = int.from_bytes(bytes(index["names"][i]), "little")
            header = disk.read_name(slot) if 0 <= slot < disk.num_slots and slot not in taken else None
            if header is None or header[0] != name:
                found.num_dropped += 1
                continue
            entry = BlockEntry(slots={Level.DISK: slot})
            if not prefix_cache.register(entry, name, tuple(index["tokens"][i].tolist())):
                found.num_dropped += 1
                continue
            disk.adopt(slot, header[1])
            taken.add(slot)
            prefix_cache.release(entry)
            digests[name] = torch.from_numpy(index["digests"][i].astype(np.float32))
        blocks.allocators[Level.DISK].take(taken)
        found.num_blocks = len(taken)
        found.sessions = json.loads(bytes(index["sessions"]).decode() or "{}")
        if found.num_blocks or found.num_dropped:
            log.info("prefix cache recovered from %s: %d blocks (%d dropped: their slots hold something else)",
                     self.path.parent, found.num_blocks, found.num_dropped)
        return found, digests
