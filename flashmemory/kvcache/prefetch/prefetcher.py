"""Prefetch: cold (L2) blocks into a bounded host staging area, warm (L1) blocks into the device staging area,
ahead of the decode step that selects them.

During a decode step the cache hands every layer's query-aware choice to the prefetcher (`on_choose`, which only
keeps the tensors). When the step is over (`on_step_end`, every layer read), the choices are folded into the
sequence's access statistics and the ranker (the heat predictor, or a plain recency/LRU ranking) scores the L2
candidates of every layer and KV head at once — one batched call per step; the top ones per KV head form each
layer's wanted set for the next step. Background threads read the wanted (slot, layer) segments that are not staged
yet, earliest layer first (the next step needs them first); segments the step itself had to read from disk stay
staged if they are wanted again (read-through). The next step's L2 read of a layer takes staged segments from
memory (a hit: read ahead by a reader thread, or kept from this step's own read) and reads the rest from disk (a
miss: "late" when a reader had it queued or in flight, "cold" when it was not wanted). A staged segment stays while
its block ranks within RETAIN_FACTOR x the wanted set, so blocks at the edge are not evicted and read again. With a
DeviceStaging (device_staging.py), the L1 candidates are ranked the same way and each layer's hottest are handed to
it (`want`), which copies them to the device in the background.

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
from dataclasses import dataclass

import torch

from flashmemory.errors import ColdBlockError, ConfigError
from flashmemory.kvcache.prefetch.access_stats import AccessStats, StepChoices
from flashmemory.kvcache.prefetch.access_trace import lru_scores
from flashmemory.kvcache.prefetch.device_staging import DeviceStaging
from flashmemory.kvcache.levels.protocol import StorageLevel
from flashmemory.kvcache.prefetch.heat_predictor import HeatPredictor
from flashmemory.kvcache.read.choice import LayerChoice
from flashmemory.kvcache.quant import Parts

logger = logging.getLogger(__name__)

STRATEGIES = ("none", "adaptive", "aggressive")
RANKERS = ("predictor", "lru")
DEPTH = {"aggressive": 2.0, "adaptive": 1.0}  # wanted blocks per KV head, as a multiple of the step's budget
ADAPTIVE_DEPTH_RANGE = (1.0, 3.0)
ADAPTIVE_DEPTH_STEP = 0.25
ADAPT_EVERY_LOOKUPS = 256  # segment lookups between two adaptive depth changes
ADAPTIVE_TARGET_HIT_RATE = 0.97  # below it (and readers keeping up) the depth grows
ADAPTIVE_SATURATED_HIT_RATE = 0.995  # above it the depth shrinks (fewer reads for the same hits)
RETAIN_FACTOR = 2.0  # a staged segment stays while its block ranks within RETAIN_FACTOR x the wanted set
RANKED_LEVELS = (1, 2)  # L1 (staged on the device) and L2 (read ahead); the levels below: on demand


@dataclass
class _Staged:
    data: bytes
    generation: int  # the slot's DiskPool generation when it was read
    prefetched: bool  # read by a prefetch thread (False: staged after a demand read)
    used: bool = False


def _any_head(top: torch.Tensor, n: int) -> torch.Tensor:
    """[layers, n] mask of the candidates some KV head ranks in its top ones (top: [layers, heads, k] positions)."""
    layers = top.shape[0]
    return torch.zeros((layers, n), dtype=torch.bool).scatter_(1, top.reshape(layers, -1), True)


class Prefetcher:
    """Owns the L2 staging area, the per-sequence access statistics, the ranker and the reader threads."""

    def __init__(self, cold_level: StorageLevel | None, num_layers: int, num_kv_heads: int, strategy: str,
                 budget_bytes: int, ranker: str = "predictor", predictor: HeatPredictor | None = None,
                 num_threads: int = 4, device_staging: DeviceStaging | None = None) -> None:
        if strategy not in DEPTH:
            raise ConfigError(f"prefetch_strategy={strategy!r}: a Prefetcher needs 'adaptive' or 'aggressive'")
        if ranker not in RANKERS:
            raise ConfigError(f"prefetch_ranker={ranker!r}: use one of {', '.join(RANKERS)}")
        self.cold_level = cold_level  # the level read ahead (L2); None: only device staging of L1
        self.device_staging = device_staging
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.strategy = strategy
        self.depth = DEPTH[strategy]
        self.budget_bytes = budget_bytes
        self.ranker = ranker
        self.predictor = predictor if predictor is not None or ranker == "lru" else HeatPredictor.load()
        self.stats_by_seq: dict[int, AccessStats] = {}
        self._choices: dict[tuple[int, int], list[LayerChoice]] = {}  # (seq_id, level) -> this step's choices
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._staged: dict[tuple[int, int], _Staged] = {}  # (slot, layer) -> verified bytes
        self._staged_bytes = 0
        self._wanted: dict[tuple[int, int], set[int]] = {}  # (seq_id, layer) -> slots wanted for the next step
        self._read_through: dict[tuple[int, int], set[int]] = {}  # (seq_id, layer) -> staged by this step's reads
        self._queue: deque[tuple[int, int, int]] = deque()  # (seq_id, slot, layer) to read, earliest layer first
        self._queued: set[tuple[int, int]] = set()
        self._reading: set[tuple[int, int]] = set()  # popped by a reader, not published yet
        self._closed = False
        self.counters = {"prefetch_issued": 0, "prefetch_completed": 0, "prefetch_hits": 0, "prefetch_misses": 0,
                         "prefetch_late_misses": 0, "prefetch_hits_prefetched": 0, "prefetch_wasted_bytes": 0,
                         "prefetch_dropped_races": 0, "prefetch_predictor_calls": 0}
        self.predictor_seconds = 0.0  # the ranker's own time (the MLP, or the LRU formula)
        self.ranking_seconds = 0.0  # everything at a step's end: statistics, features, ranking, wanted sets
        self._window = [0, 0, 0]  # hits, lookups, late misses since the last adaptive depth change
        self._threads = [threading.Thread(target=self._run, name=f"flashmemory-prefetch-{i}", daemon=True)
                         for i in range(num_threads if cold_level is not None else 0)]
        for t in self._threads:
            t.start()

    # ---- ranking (main thread) ------------------------------------------------------------------------------

    def on_choose(self, choice: LayerChoice) -> None:
        """A layer's choice during a decode step: kept (no copy, no work) until the step ends."""
        if choice.level not in RANKED_LEVELS:  # a level below L2 is not read ahead: nothing to rank
            return
        self._choices.setdefault((choice.seq_id, choice.level), []).append(choice)

    def on_step_abort(self, seq_id: int) -> None:
        """The step failed part-way: drop the choices it made so far (the step runs again)."""
        for key in [k for k in self._choices if k[0] == seq_id]:
            del self._choices[key]

    def on_step_end(self, seq_id: int) -> None:
        """The decode step of `seq_id` read every layer: fold its choices into the statistics, rank every layer's
        L2 candidates in one batched call and make the top ones per KV head each layer's wanted set; with device
        staging, rank the L1 candidates the same way and hand each layer's hottest to the staging area."""
        started = time.perf_counter()
        stats = self.stats_by_seq.get(seq_id)
        if stats is None:
            stats = self.stats_by_seq[seq_id] = AccessStats(self.num_layers, self.num_kv_heads)
        steps: dict[int, StepChoices] = {}
        for level in RANKED_LEVELS:
            choices = self._choices.pop((seq_id, level), None)
            if choices:
                steps[level] = StepChoices.stack(choices)
                stats.update(steps[level])
        cold = steps.get(2)
        if cold is None or cold.indices.numel() == 0:
            self._want(seq_id, {})
        else:
            scores = self._rank(stats, cold)  # [layers, heads, n]
            n = scores.shape[2]
            keep = min(n, math.ceil(self.depth * cold.budget))
            retain = min(n, math.ceil(RETAIN_FACTOR * keep))
            top = scores.topk(retain, dim=-1, sorted=True).indices  # [layers, heads, retain], hottest first
            wanted, retained = _any_head(top[..., :keep], n), _any_head(top, n)
            assert cold.slots is not None
            slots = cold.slots.numpy()

            def by_layer(mask: torch.Tensor) -> dict[int, set[int]]:
                return {layer: set(slots[row].tolist()) for layer, row in zip(cold.layers.tolist(), mask.numpy())}

            self._want(seq_id, by_layer(wanted), by_layer(retained))
            if self.strategy == "adaptive" and self._window[1] >= ADAPT_EVERY_LOOKUPS:
                self._adapt()
        warm = steps.get(1)
        if self.device_staging is not None and warm is not None and warm.indices.numel():
            self._stage_warm(seq_id, stats, warm)
        self.counters["prefetch_predictor_calls"] += 1
        self.ranking_seconds += time.perf_counter() - started

    def _rank(self, stats: AccessStats, step: StepChoices) -> torch.Tensor:
        """Ranking scores [layers, heads, n] of a step's candidates on one level (higher = hotter)."""
        features = stats.features(step)  # [F, layers, heads, n]
        width, layers, heads, n = features.shape
        started = time.perf_counter()
        if self.ranker == "lru":
            scores = lru_scores(features.movedim(0, -1))
        else:
            assert self.predictor is not None
            scores = torch.as_tensor(self.predictor.rank(features.reshape(width, -1))).reshape(layers, heads, n)
        self.predictor_seconds += time.perf_counter() - started
        return scores

    def _stage_warm(self, seq_id: int, stats: AccessStats, warm: StepChoices) -> None:
        """Each layer's L1 blocks the next step most likely reads, hottest first, to the device staging area."""
        assert self.device_staging is not None and warm.slots is not None
        scores = self._rank(stats, warm)  # [layers, heads, n]
        n = scores.shape[2]
        keep = min(n, math.ceil(self.depth * warm.budget))
        wanted = _any_head(scores.topk(keep, dim=-1).indices, n)
        heat = torch.where(wanted, scores.amax(dim=1), float("-inf"))  # a block is as hot as its hottest head
        order = heat.argsort(dim=1, descending=True)
        counts = wanted.sum(dim=1).tolist()
        slots = warm.slots[order].tolist()
        for layer, row, count in zip(warm.layers.tolist(), slots, counts):
            self.device_staging.want(layer, row[:count], seq_id)

    def _want(self, seq_id: int, wanted_by_layer: dict[int, set[int]],
              retained_by_layer: dict[int, set[int]] | None = None) -> None:
        """Make these the sequence's wanted sets (layers not named want nothing): queue the wanted segments not
        staged yet, earliest layer first; keep staged segments that are still retained (wanted, or ranked just
        below: hysteresis, so a block hovering at the edge of the wanted set is not evicted and read again), evict
        the rest."""
        retained_by_layer = wanted_by_layer if retained_by_layer is None else retained_by_layer
        with self._lock:
            for key in {k for k in (*self._wanted, *self._read_through) if k[0] == seq_id}:
                keep = retained_by_layer.get(key[1], set())
                for slot in (self._wanted.pop(key, set()) | self._read_through.pop(key, set())) - keep:
                    self._evict((slot, key[1]))
            for layer in sorted(wanted_by_layer):
                slots = wanted_by_layer[layer]
                self._wanted[(seq_id, layer)] = retained_by_layer.get(layer, set()) | slots
                for slot in sorted(slots):
                    key = (slot, layer)
                    if key in self._staged or key in self._queued:
                        continue
                    assert self.cold_level is not None
                    if self._staged_bytes + self.cold_level.segment_bytes * (len(self._queued) + 1) > \
                            self.budget_bytes:
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
                key = (slot, layer)
                self._queued.discard(key)
                if slot not in self._wanted.get((seq_id, layer), ()) or key in self._staged:
                    continue  # no longer wanted, or the step read it meanwhile
                generation = self.cold_level.generation_of(slot)
                self._reading.add(key)
            data = None
            try:
                data = self.cold_level.read_segment(slot, layer, count_failures=False)  # lock not held: disk time
            except ColdBlockError:
                with self._lock:
                    self.counters["prefetch_dropped_races"] += 1
            except OSError:
                logger.exception("prefetch read of cold slot %d failed", slot)
            with self._lock:
                self._reading.discard(key)
                if data is not None:
                    self.counters["prefetch_completed"] += 1
                    self._publish(seq_id, slot, layer, data, generation, prefetched=True)

    def _publish(self, seq_id: int, slot: int, layer: int, data: bytes, generation: int, prefetched: bool) -> bool:
        """Stage a fully read, verified segment (lock held); False when it was not staged."""
        key = (slot, layer)
        current = self.cold_level.generation_of(slot)
        unwanted = prefetched and slot not in self._wanted.get((seq_id, layer), ())
        full = self._staged_bytes + len(data) > self.budget_bytes
        if generation != current or unwanted or full or key in self._staged:
            if prefetched:
                self.counters["prefetch_wasted_bytes"] += len(data)
            return False
        self._staged[key] = _Staged(data, generation, prefetched)
        self._staged_bytes += len(data)
        return True

    # ---- the decode step's read -----------------------------------------------------------------------------

    def read_layer(self, slots: list[int], layer: int, seq_id: int, decoding: bool) -> Parts:
        """`get_layer` as the read path wants it: parts [num_kv_heads, len(slots), ...]."""
        return {name: t.transpose(0, 1) for name, t in self.get_layer(slots, layer, seq_id, decoding).items()}

    def get_layer(self, slots: list[int], layer: int, seq_id: int = -1, decoding: bool = True) -> Parts:
        """The level's layer read through the staging area: staged segments are served from memory, the rest read.

        A decode step's lookups are counted and its disk reads stay staged until the step's end decides whether
        the next step wants them (read-through); prefill reads (`decoding=False`) pass straight through.
        """
        pool = self.cold_level
        assert pool is not None
        pool.check_medium()
        chunks: list[bytes] = [b""] * len(slots)
        missing: list[int] = []  # positions in `slots` read from the disk
        hits = late = prefetched = 0
        with self._lock:  # one pass over the staging area for the whole layer
            for i, slot in enumerate(slots):
                key = (slot, layer)
                entry = self._staged.get(key)
                if entry is not None:
                    if entry.generation == pool.generation_of(slot):
                        entry.used = True
                        chunks[i] = entry.data
                        hits += 1
                        prefetched += entry.prefetched
                        continue
                    self._evict(key)  # its slot was rewritten: never served
                missing.append(i)
                late += key in self._queued or key in self._reading
        reads = []
        for i in missing:  # lock not held: disk time
            generation = pool.generation_of(slots[i])
            chunks[i] = pool.read_segment(slots[i], layer)
            reads.append((slots[i], generation, chunks[i]))
        if decoding:
            with self._lock:
                for slot, generation, data in reads:
                    if self._publish(seq_id, slot, layer, data, generation, prefetched=False):
                        self._read_through.setdefault((seq_id, layer), set()).add(slot)
                self.counters["prefetch_hits"] += hits
                self.counters["prefetch_misses"] += len(slots) - hits
                self.counters["prefetch_late_misses"] += late
                self.counters["prefetch_hits_prefetched"] += prefetched
                self._window[0] += hits
                self._window[1] += len(slots)
                self._window[2] += late
        return pool.parts_from_segments(b"".join(chunks), len(slots))

    def _adapt(self) -> None:
        """Adaptive depth, from the hit rate and how the readers keep up with the compute: when misses are mostly
        late (a reader had the segment queued: the compute outruns the disk) a deeper set only adds reads, so the
        depth shrinks; when they are mostly cold (the segment was not wanted) and hits are below target, it grows;
        when hits are near perfect it shrinks to save reads and staging memory."""
        hits, lookups, late = self._window
        hit_rate = hits / max(lookups, 1)
        cold = lookups - hits - late
        low, high = ADAPTIVE_DEPTH_RANGE
        if late > cold:
            self.depth = max(low, self.depth - ADAPTIVE_DEPTH_STEP)
        elif hit_rate < ADAPTIVE_TARGET_HIT_RATE:
            self.depth = min(high, self.depth + ADAPTIVE_DEPTH_STEP)
        elif hit_rate > ADAPTIVE_SATURATED_HIT_RATE:
            self.depth = max(low, self.depth - ADAPTIVE_DEPTH_STEP)
        self._window = [0, 0, 0]

    # ---- lifecycle and reporting ----------------------------------------------------------------------------

    def forget(self, seq_id: int) -> None:
        """Drop a finished sequence's statistics and staged segments."""
        self.stats_by_seq.pop(seq_id, None)
        if self.device_staging is not None:
            self.device_staging.forget(seq_id)
        for key in [k for k in self._choices if k[0] == seq_id]:
            del self._choices[key]
        self._want(seq_id, {})

    def stats(self) -> dict[str, int | float]:
        with self._lock:
            out: dict[str, int | float] = dict(self.counters)
            out["prefetch_staged_bytes"] = self._staged_bytes
        lookups = out["prefetch_hits"] + out["prefetch_misses"]
        out["prefetch_hit_rate"] = out["prefetch_hits"] / lookups if lookups else 0.0
        steps = out["prefetch_predictor_calls"]
        out["prefetch_predictor_seconds"] = self.predictor_seconds
        out["prefetch_ranking_seconds"] = self.ranking_seconds
        out["predictor_ms"] = 1000 * self.predictor_seconds / steps if steps else 0.0  # per decode step
        out["prefetch_ranking_ms"] = 1000 * self.ranking_seconds / steps if steps else 0.0  # per decode step
        out["prefetch_depth"] = self.depth
        return out

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._queue.clear()
            self._work.notify_all()
        for t in self._threads:
            t.join(timeout=5)
