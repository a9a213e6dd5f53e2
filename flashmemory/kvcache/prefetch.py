"""Prefetch of cold (L2) blocks into a bounded host staging area, ahead of the decode step that selects them.

After each query-aware choice on L2 (one layer, one step), the ranker (the heat predictor, or a plain recency/LRU
ranking) orders that layer's L2 candidates by how likely the next step selects them; the top ones per KV head form
the layer's wanted set. Background threads read the wanted (slot, layer) segments that are not staged yet; segments
the step itself had to read from disk are staged too (read-through). The next step's L2 read of that layer takes
staged segments from memory (a hit) and reads the rest from disk (a miss).

NOTE: a segment becomes visible only after it was read completely and its crc32 verified, and only together with
the slot generation it was read under; DiskPool bumps a slot's generation before rewriting or freeing it, so a
staged copy of older bytes is never served. Threads never hold the lock while reading the disk.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from flashmemory.errors import ColdBlockError, ConfigError
from flashmemory.kvcache.access_trace import AccessStats, ChoiceEvent, lru_scores
from flashmemory.kvcache.disk_pool import DiskPool
from flashmemory.kvcache.heat_predictor import HeatPredictor
from flashmemory.kvcache.quant import Parts

logger = logging.getLogger(__name__)

STRATEGIES = ("none", "adaptive", "aggressive")
RANKERS = ("predictor", "lru")
DEPTH = {"aggressive": 2.0, "adaptive": 1.0}  # wanted blocks per KV head, as a multiple of the step's budget
ADAPTIVE_DEPTH_RANGE = (1.0, 3.0)
ADAPT_EVERY_LOOKUPS = 256  # segment lookups between two adaptive depth changes


@dataclass
class _Staged:
    data: bytes
    generation: int  # the slot's DiskPool generation when it was read
    prefetched: bool  # read by a prefetch thread (False: staged after a demand read)
    used: bool = False


class Prefetcher:
    """Owns the L2 staging area, the per-sequence access statistics, the ranker and the reader threads."""

    def __init__(self, disk_pool: DiskPool, num_layers: int, num_kv_heads: int, strategy: str, budget_bytes: int,
                 slot_of: Callable[[int, int], int | None], ranker: str = "predictor",
                 predictor: HeatPredictor | None = None, num_threads: int = 4) -> None:
        if strategy not in DEPTH:
            raise ConfigError(f"prefetch_strategy={strategy!r}: a Prefetcher needs 'adaptive' or 'aggressive'")
        if ranker not in RANKERS:
            raise ConfigError(f"prefetch_ranker={ranker!r}: use one of {', '.join(RANKERS)}")
        self.disk_pool = disk_pool
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.strategy = strategy
        self.depth = DEPTH[strategy]
        self.budget_bytes = budget_bytes
        self.slot_of = slot_of  # (seq_id, logical block index) -> its L2 slot, or None
        self.ranker = ranker
        self.predictor = predictor if predictor is not None or ranker == "lru" else HeatPredictor.load()
        self.stats_by_seq: dict[int, AccessStats] = {}
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._staged: dict[tuple[int, int], _Staged] = {}  # (slot, layer) -> verified bytes
        self._staged_bytes = 0
        self._wanted: dict[tuple[int, int], set[int]] = {}  # (seq_id, layer) -> slots wanted for the next step
        self._queue: deque[tuple[int, int, int]] = deque()  # (seq_id, slot, layer) to read
        self._queued: set[tuple[int, int]] = set()
        self._pending: dict[tuple[int, int], set[int]] = {}  # (seq_id, layer) -> wanted set, applied after the read
        self._closed = False
        self.counters = {"prefetch_issued": 0, "prefetch_completed": 0, "prefetch_hits": 0, "prefetch_misses": 0,
                         "prefetch_wasted_bytes": 0, "prefetch_dropped_races": 0, "prefetch_predictor_calls": 0}
        self.predictor_seconds = 0.0
        self._window = [0, 0, 0]  # hits, lookups, queue length seen at adaptive checks (for the depth rule)
        self._threads = [threading.Thread(target=self._run, name=f"flashmemory-prefetch-{i}", daemon=True)
                         for i in range(num_threads)]
        for t in self._threads:
            t.start()

    # ---- ranking (main thread, called by the cache after each query-aware choice) ---------------------------

    def on_choose(self, event: ChoiceEvent) -> None:
        stats = self.stats_by_seq.get(event.seq_id)
        if stats is None:
            stats = self.stats_by_seq[event.seq_id] = AccessStats(self.num_layers, self.num_kv_heads)
        stats.update(event)
        if event.level != 2 or event.indices.size == 0:
            return
        started = time.perf_counter()
        features = stats.features(event)  # [heads, n, F]
        heads, n, width = features.shape
        flat = features.reshape(heads * n, width)
        if self.ranker == "lru":
            scores = lru_scores(flat).reshape(heads, n)
        else:
            assert self.predictor is not None
            scores = self.predictor.logits(flat).reshape(heads, n)
        keep = min(n, math.ceil(self.depth * event.chosen.shape[1]))
        top = np.argpartition(-scores, keep - 1, axis=1)[:, :keep] if keep < n else np.arange(n)[None]
        blocks = np.unique(event.indices[top])
        self.predictor_seconds += time.perf_counter() - started
        self.counters["prefetch_predictor_calls"] += 1
        slots = {s for s in (self.slot_of(event.seq_id, int(b)) for b in blocks) if s is not None}
        # NOTE: applied after this step has read the layer (get_layer), so the new set cannot evict a segment the
        # step is about to read.
        key = (event.seq_id, event.layer)
        stale = self._pending.pop(key, None)
        if stale is not None:
            self._want(event.seq_id, event.layer, stale)
        self._pending[key] = slots

    def _want(self, seq_id: int, layer: int, slots: set[int]) -> None:
        """Make `slots` the layer's wanted set: evict staged segments no longer wanted, queue the missing ones."""
        with self._lock:
            old = self._wanted.get((seq_id, layer), set())
            self._wanted[(seq_id, layer)] = slots
            for slot in old - slots:
                self._evict((slot, layer))
            for slot in sorted(slots):
                key = (slot, layer)
                if key in self._staged or key in self._queued:
                    continue
                if self._staged_bytes + self.disk_pool.segment_bytes * (len(self._queued) + 1) > self.budget_bytes:
                    break  # staging area full: the rest is read on demand
                self._queue.append((seq_id, slot, layer))
                self._queued.add(key)
                self.counters["prefetch_issued"] += 1
            self._work.notify_all()

    def _evict(self, key: tuple[int, int]) -> None:
        entry = self._staged.pop(key, None)
        if entry is None:
            return
        self._staged_bytes -= len(entry.data)
        if entry.prefetched and not entry.used:
            self.counters["prefetch_wasted_bytes"] += len(entry.data)

    # ---- reader threads -------------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._work.wait()
                if self._closed:
                    return
                seq_id, slot, layer = self._queue.popleft()
                self._queued.discard((slot, layer))
                if slot not in self._wanted.get((seq_id, layer), ()) or (slot, layer) in self._staged:
                    continue  # no longer wanted, or the step read it meanwhile
                generation = self.disk_pool.generation.get(slot, 0)
            try:
                data = self.disk_pool.read_segment(slot, layer, count_failures=False)  # lock not held: disk time
            except ColdBlockError:
                with self._lock:
                    self.counters["prefetch_dropped_races"] += 1
                continue
            except OSError:
                logger.exception("prefetch read of cold slot %d failed", slot)
                continue
            with self._lock:
                self.counters["prefetch_completed"] += 1
                self._publish(seq_id, slot, layer, data, generation, prefetched=True)

    def _publish(self, seq_id: int, slot: int, layer: int, data: bytes, generation: int, prefetched: bool) -> None:
        """Stage a fully read, verified segment (lock held). A demand read is staged whether or not it is wanted:
        the wanted set applied right after the step's read keeps it or evicts it."""
        key = (slot, layer)
        current = self.disk_pool.generation.get(slot, 0)
        unwanted = prefetched and slot not in self._wanted.get((seq_id, layer), ())
        full = self._staged_bytes + len(data) > self.budget_bytes
        if generation != current or unwanted or full or key in self._staged:
            if prefetched:
                self.counters["prefetch_wasted_bytes"] += len(data)
            return
        self._staged[key] = _Staged(data, generation, prefetched)
        self._staged_bytes += len(data)

    # ---- the decode step's read -----------------------------------------------------------------------------

    def get_layer(self, slots: list[int], layer: int, seq_id: int = -1) -> Parts:
        """DiskPool.get_layer through the staging area: staged segments are served from memory, the rest read.

        During decoding (the layer's choice was just ranked) a segment read from disk is staged when the next step
        wants it too, and the lookups are counted; prefill reads (no ranking) pass straight through.
        """
        self.disk_pool.check_file()
        pending = self._pending.pop((seq_id, layer), None)
        chunks: list[bytes] = []
        hits = 0
        for slot in slots:
            key = (slot, layer)
            with self._lock:
                entry = self._staged.get(key)
                valid = entry is not None and entry.generation == self.disk_pool.generation.get(slot, 0)
                if valid:
                    entry.used = True
                elif entry is not None:
                    self._evict(key)
            if valid:
                chunks.append(entry.data)
                hits += 1
                continue
            generation = self.disk_pool.generation.get(slot, 0)
            data = self.disk_pool.read_segment(slot, layer)
            chunks.append(data)
            if pending is not None and slot in pending:
                with self._lock:
                    self._publish(seq_id, slot, layer, data, generation, prefetched=False)
        if pending is None:
            return self.disk_pool.unflatten(b"".join(chunks), len(slots))
        with self._lock:
            self.counters["prefetch_hits"] += hits
            self.counters["prefetch_misses"] += len(slots) - hits
            self._window[0] += hits
            self._window[1] += len(slots)
            queued = len(self._queue)
        if self.strategy == "adaptive" and self._window[1] >= ADAPT_EVERY_LOOKUPS:
            self._adapt(queued)
        self._want(seq_id, layer, pending)
        return self.disk_pool.unflatten(b"".join(chunks), len(slots))

    def _adapt(self, queued: int) -> None:
        """Adaptive depth: deeper while hits are missing and the readers keep up; shallower when the readers fall
        behind (reads still queued when the step needs them) or when hits are already high."""
        hit_rate = self._window[0] / max(self._window[1], 1)
        low, high = ADAPTIVE_DEPTH_RANGE
        if queued > 0:
            self.depth = max(low, self.depth - 0.25)
        elif hit_rate < 0.9:
            self.depth = min(high, self.depth + 0.25)
        elif hit_rate > 0.97:
            self.depth = max(low, self.depth - 0.25)
        self._window = [0, 0, 0]

    # ---- lifecycle and reporting ----------------------------------------------------------------------------

    def forget(self, seq_id: int) -> None:
        """Drop a finished sequence's statistics and staged segments."""
        self.stats_by_seq.pop(seq_id, None)
        for key in [k for k in self._pending if k[0] == seq_id]:
            del self._pending[key]
        with self._lock:
            for key in [k for k in self._wanted if k[0] == seq_id]:
                for slot in self._wanted.pop(key):
                    self._evict((slot, key[1]))

    def stats(self) -> dict[str, int | float]:
        with self._lock:
            out: dict[str, int | float] = dict(self.counters)
            out["prefetch_staged_bytes"] = self._staged_bytes
        lookups = out["prefetch_hits"] + out["prefetch_misses"]
        out["prefetch_hit_rate"] = out["prefetch_hits"] / lookups if lookups else 0.0
        calls = out["prefetch_predictor_calls"]
        out["predictor_ms"] = 1000 * self.predictor_seconds / calls if calls else 0.0  # per layer of a step
        out["predictor_ms_per_step"] = out["predictor_ms"] * self.num_layers
        out["prefetch_depth"] = self.depth
        return out

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._queue.clear()
            self._work.notify_all()
        for t in self._threads:
            t.join(timeout=5)
