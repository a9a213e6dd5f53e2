"""SharedLevel: the tiered cache's handle on the shared level (a Redis every replica reaches).

Looking up: the names of a prompt's blocks past its local prefix are read in pipelined batches,
in order, up to the first miss; each value must decode as that block's record (block_record.py),
and one that does not is a miss counted by its reason (`load_failures`), never served. The cache
installs the hits as cached blocks (TieredKVCache.import_shared_prefix) before the request is
scheduled, so the scheduler counts them as any cached prefix and the prefill skips them.

Publishing: a block a prefill wrote and the prefix cache named is copied (its FP16 master) and
handed to a background thread that encodes and writes it, so a step never waits on the network.
The queue is bounded: when Redis is slower than the prefill, blocks are dropped, counted."""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter

import torch

from flashmemory.errors import RemoteUnavailableError
from flashmemory.kvcache.remote.block_record import (BlockGeometry, RemoteRecordError,
                                                     decode_record, encode_record)
from flashmemory.kv_settings import redacted_url
from flashmemory.kvcache.kv_stats import RemoteStats
from flashmemory.kvcache.remote.redis_store import RedisBlockStore, RedisSettings

logger = logging.getLogger(__name__)

LOOKUP_BATCH_BLOCKS = 32  # names per pipelined GET: one round trip each
PUBLISH_QUEUE_BLOCKS = 256  # blocks waiting for the publisher before new ones are dropped
CLOSE_WAIT_S = 5.0  # at close, how long the blocks still queued may take to go out


class SharedLevel:
    """Lookups on the caller's thread, publishing on its own."""

    def __init__(self, store: RedisBlockStore, geometry: BlockGeometry) -> None:
        self.store = store
        self.geometry = geometry
        self._counts: Counter[str] = Counter()
        self._skipped: Counter[str] = Counter()
        self._failures: Counter[str] = Counter()
        self._queue: queue.Queue = queue.Queue(PUBLISH_QUEUE_BLOCKS)
        self._thread = threading.Thread(target=self._publish_loop, name="fm-shared-kv",
                                        daemon=True)
        self._thread.start()

    # ---- lookups (the engine's thread) ----------------------------------------------------------

    def lookup(self, names: list[int],
               blocks: list[tuple[int, ...]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Keys and values (float16, CPU) of the leading blocks found: blocks[i] named names[i],
        up to the first that is missing or not believable."""
        self._counts["lookups"] += 1
        found: list[tuple[torch.Tensor, torch.Tensor]] = []
        for start in range(0, len(names), LOOKUP_BATCH_BLOCKS):
            batch = names[start : start + LOOKUP_BATCH_BLOCKS]
            values = self.store.get_many(batch)
            for offset, value in enumerate(values):
                i = start + offset
                if value is None:
                    self._counts["miss_blocks"] += 1
                    return found
                try:
                    found.append(decode_record(self.geometry, blocks[i], value))
                except RemoteRecordError as e:
                    self.record_failure(e.reason)
                    logger.warning("a shared KV block (%s) was not served: %s",
                                   self.store.key(names[i]), e)
                    self._counts["miss_blocks"] += 1
                    return found
        return found

    def record_failure(self, reason: str) -> None:
        self._failures[reason] += 1

    def installed(self, num_blocks: int) -> None:
        self._counts["hit_blocks"] += num_blocks

    # ---- publishing -----------------------------------------------------------------------------

    def publish(self, name: int, token_ids: tuple[int, ...], keys: torch.Tensor,
                values: torch.Tensor) -> None:
        """Queue a freshly named block (keys, values [num_layers, num_kv_heads, block_size,
        head_dim]) for the publisher; copied now, as its buffers are reused."""
        if not self.store.available:
            self._skipped["down"] += 1
            return
        item = (name, token_ids, keys.detach().to("cpu", copy=True),
                values.detach().to("cpu", copy=True))
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self._skipped["queue"] += 1

    def _publish_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                name, token_ids, keys, values = item
                result = self.store.put(name, encode_record(self.geometry, token_ids, keys, values))
                if result == "stored":
                    self._counts["published_blocks"] += 1
                elif result == "exists":
                    self._counts["existing_blocks"] += 1
                else:
                    self._skipped[result] += 1
            except Exception:  # noqa: BLE001 - an optimisation: never the engine's fault
                logger.exception("publishing a block to the shared KV level failed")
                self._skipped["error"] += 1
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every queued block went out (tests, shutdown)."""
        self._queue.join()

    # ---- reporting and shutdown -----------------------------------------------------------------

    def stats(self) -> RemoteStats:
        c, counters = self._counts, self.store.counters
        return RemoteStats(
            remote_kv_lookups=c["lookups"], remote_kv_hit_blocks=c["hit_blocks"],
            remote_kv_miss_blocks=c["miss_blocks"],
            remote_kv_published_blocks=c["published_blocks"],
            remote_kv_existing_blocks=c["existing_blocks"],
            remote_kv_network_failures=sum(n for k, n in counters.items()
                                           if k.endswith("_failures")),
            remote_kv_available=int(self.store.answering),
            publish_skipped=dict(self._skipped), load_failures=dict(self._failures))

    def close(self) -> None:
        """Let the queued blocks go out (bounded), stop the publisher, close the connection."""
        try:
            self._queue.put(None, timeout=CLOSE_WAIT_S)
        except queue.Full:
            logger.warning("closing with %d blocks not yet published", self._queue.qsize())
        self._thread.join(CLOSE_WAIT_S)
        self.store.close()


def shared_level_for(cfg) -> SharedLevel | None:
    """The shared level a cache's settings ask for (remote_kv_url), connected; None when unset.
    A Redis that does not answer is RemoteUnavailableError with remote_kv_required, else one
    warning: the cache starts with its local levels and tries Redis again after a pause."""
    if cfg.remote_kv_url is None:
        return None
    store = RedisBlockStore(RedisSettings(
        cfg.remote_kv_url, cfg.remote_kv_namespace, cfg.remote_kv_ttl_s, cfg.remote_kv_max_bytes,
        cfg.remote_kv_timeout_ms / 1000))
    if not store.ping():
        url = redacted_url(cfg.remote_kv_url)
        if cfg.remote_kv_required:
            store.close()
            raise RemoteUnavailableError(
                f"the shared KV level at {url} does not answer: start redis-server there (or fix "
                "remote_kv_url), or set remote_kv_required=False to start with the local levels")
        logger.warning("the shared KV level at %s does not answer: starting with the local levels "
                       "only (remote_kv_required=True refuses to start instead)", url)
    geometry = BlockGeometry(cfg.prefix_namespace(), cfg.num_layers, cfg.num_kv_heads,
                             cfg.block_size, cfg.head_dim)
    return SharedLevel(store, geometry)
