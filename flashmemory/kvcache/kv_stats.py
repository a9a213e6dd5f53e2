"""KVStats: one snapshot of a KV cache's figures as typed records (as vLLM v1's metrics/stats.py).

The cache builds it (TieredKVCache.kv_stats); the metrics, the stats line, the CLI and the tools
read its attributes, so a renamed field fails where it is read instead of silently dropping a
series. `as_dict()` is for the JSON edges only: engine.stats(), eval and bench files, MATS logs.
Its keys are the public names users read (L0_blocks, prefix_cache_hits, ...), a level's prefixed
by its label (blocks.py level_label), in the order they have always come in.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from flashmemory.kvcache.manager.blocks import level_label
from flashmemory.kvcache.manager.prefix_cache import PrefixCache

Number = int | float
_OCCUPANCY = ("blocks", "blocks_total", "bytes", "bytes_capacity", "cached_blocks", "cached_bytes")


def _present(record: object) -> dict[str, Number]:
    """A flat record's fields in declaration order, those that are None left out (not
    dataclasses.asdict: it deep-copies, and a server takes a snapshot every step)."""
    out = {}
    for name in _field_names(type(record)):
        value = getattr(record, name)
        if value is not None:
            out[name] = value
    return out


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


@dataclass
class MediumCounters:
    """A storage medium's own counters (StorageLevel.counters); None: it does not count that."""

    bytes_read: int | None = None  # read back from a file
    load_failures_missing: int | None = None  # blocks that failed to load, by reason
    load_failures_truncated: int | None = None
    load_failures_checksum: int | None = None
    load_failures_header: int | None = None
    write_failures_full: int | None = None
    write_failures_io: int | None = None
    bytes_committed: int | None = None  # memory or disk the OS committed to the level so far
    bytes_allocated: int | None = None  # device bytes the storage holds now (the L0 arena)
    # A file's freed records whose disk blocks compaction has not given back yet, and what it did.
    bytes_reclaimable: int | None = None
    bytes_reclaimed: int | None = None
    file_recreated: int | None = None
    files_refused: int | None = None
    failed: int | None = None  # 1 while the medium is not as it should be (health says why)
    other: dict[str, int] = field(default_factory=dict)  # a medium's counters not named above

    LOAD_FAILURE_REASONS = ("missing", "truncated", "checksum", "header")

    @classmethod
    def of(cls, counters: dict[str, int]) -> MediumCounters:
        known = _field_names(cls)
        other = {k: v for k, v in counters.items() if k not in known}
        if not other:
            return cls(**counters)
        return cls(**{k: v for k, v in counters.items() if k in known}, other=other)

    @property
    def load_failures(self) -> dict[str, int] | None:
        """Blocks that failed to load, by reason; None for a medium that never fails a load."""
        if self.load_failures_missing is None:
            return None
        return {reason: getattr(self, f"load_failures_{reason}") or 0
                for reason in self.LOAD_FAILURE_REASONS}

    def as_dict(self) -> dict[str, int]:
        out = {k: v for k, v in _present(self).items() if k != "other"}
        return {**out, **self.other}


@dataclass
class LevelStats:
    """One level's figures: what it holds, its medium's counters, and its share of selection and
    of the prefix cache."""

    level: int  # its position in the hierarchy
    name: str  # a word for it after its label ("L2 disk"; manager/hierarchy.py)
    blocks: int  # in use (cached blocks nobody uses are counted free, as vLLM does)
    blocks_total: int
    bytes: int  # L0: its slots in use, the newest tokens' rows and the device staging area
    bytes_capacity: int
    cached_blocks: int  # held only by the prefix cache
    cached_bytes: int
    medium: MediumCounters
    candidate_blocks: int | None = None  # below L0: blocks decode steps chose among (all layers)
    selected_fraction: float | None = None  # of those, the share they attended
    prefix_hit_blocks: int | None = None  # reused blocks whose fastest copy was here
    prefix_evicted_blocks: int | None = None  # cached copies dropped from here to make room

    @property
    def label(self) -> str:
        return level_label(self.level)

    @property
    def usage(self) -> float:
        """Bytes held over capacity (0-1)."""
        return self.bytes / self.bytes_capacity if self.bytes_capacity else 0.0


@dataclass
class SelectionStats:
    """Query-aware selection over the levels below L0 (per level: in LevelStats)."""

    selection_steps: int  # decode steps that chose among old blocks
    selection_old_read_fraction: float  # old blocks attended, over those held
    # Old blocks whose keys a decode step read, over those held: the attended ones and, with
    # selection_rescore_factor, the extra candidates of the second pass (keys only).
    selection_old_keys_read_fraction: float
    selection_ms_per_step: float
    selection_digest_bytes_per_token: float
    selection_digest_bytes: int


@dataclass(frozen=True)
class Move:
    """KV bytes written into a level from another ("new": fresh KV), since the cache started."""

    source: str  # a level's label, or "new"
    dest: str
    bytes: int

    @property
    def route(self) -> str:
        return f"{self.source}->{self.dest}"


@dataclass
class PrefixStats:
    """The prefix cache (vLLM's names for queries and hits, counted in tokens)."""

    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_rate: float
    prefix_cache_blocks: int
    prefix_cache_unused_blocks: int
    prefix_cache_lossy_refusals: int
    prefix_cache_bad_blocks: int
    bad_blocks_by_reason: dict[str, int] = field(default_factory=dict)  # sorted by reason

    def as_dict(self) -> dict[str, Number]:
        out = {k: v for k, v in _present(self).items() if k != "bad_blocks_by_reason"}
        out.update({f"prefix_cache_bad_blocks_{reason}": n
                    for reason, n in self.bad_blocks_by_reason.items()})
        return out


def prefix_stats(cache: PrefixCache) -> PrefixStats:
    """The prefix cache's figures (its per-level ones go into each LevelStats)."""
    return PrefixStats(cache.queried_tokens, cache.hit_tokens, cache.hit_rate, len(cache.index),
                       cache.num_unused, cache.lossy_refusals, sum(cache.bad_blocks.values()),
                       dict(sorted(cache.bad_blocks.items())))


@dataclass
class PersistStats:
    """What recovery of the persistent prefix cache refused (persist_cache; prefix_store.py)."""

    persist_index_discarded: int = 0
    persist_records_recovered: int = 0
    persist_records_discarded_invalid: int = 0
    persist_records_discarded_stale: int = 0
    persist_records_discarded_unauthenticated: int = 0
    persist_records_discarded_namespace: int = 0
    persist_sessions_discarded: int = 0


@dataclass
class PrefetchStats:
    """The prefetcher of the level below L1 (prefetch/prefetcher.py), since it started."""

    prefetch_issued: int
    prefetch_completed: int
    prefetch_hits: int
    prefetch_misses: int
    prefetch_late_misses: int
    prefetch_hits_prefetched: int
    prefetch_wasted_bytes: int
    prefetch_dropped_races: int
    prefetch_predictor_calls: int
    prefetch_staged_bytes: int
    prefetch_hit_rate: float
    prefetch_predictor_seconds: float
    prefetch_ranking_seconds: float
    predictor_ms: float  # per decode step
    prefetch_ranking_ms: float  # per decode step
    prefetch_depth: int


@dataclass
class StagingStats:
    """L1 blocks copied to the device ahead of the step that reads them (device_staging.py)."""

    device_staging_issued: int
    device_staging_hits: int
    device_staging_misses: int
    device_staging_wasted_bytes: int
    device_staging_bytes: int
    device_staging_capacity_bytes: int


@dataclass
class LocalityStats:
    """placement_policy="locality": what placement by access locality did (kvcache/locality.py)."""

    locality_raised_to_device: int  # old blocks given an L0 copy
    locality_raised_to_host: int  # blocks brought back to L1 from a level below
    locality_sunk: int  # blocks that left L1 early, never chosen
    locality_deferred: int  # role updates held back while the link was saturated
    link_utilization: float  # the cache's moves over the link's rate, last measured (0-1)


@dataclass
class RemoteStats:
    """remote_kv_url: what the shared level did since start-up (kvcache/remote/)."""

    remote_kv_lookups: int  # prompts looked up past their local prefix
    remote_kv_hit_blocks: int  # blocks read from the shared level and installed here
    remote_kv_miss_blocks: int  # lookups that ended at a name with no (believable) value
    remote_kv_published_blocks: int  # blocks this replica wrote
    remote_kv_existing_blocks: int  # blocks another replica had written first
    remote_kv_network_failures: int  # calls that timed out or lost the connection
    remote_kv_available: int  # 1: Redis answered the last call; 0: it did not
    # blocks not published, by reason: down, cap (remote_kv_max_mb), full (Redis refused), queue
    publish_skipped: dict[str, int] = field(default_factory=dict)
    # values read but not served, by reason (block_record.py's; "capacity": no room here)
    load_failures: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Number]:
        out: dict[str, Number] = {name: getattr(self, name) for name in _field_names(type(self))
                                  if name.startswith("remote_kv_")}
        for reason, n in sorted(self.publish_skipped.items()):
            out[f"remote_kv_publish_skipped_{reason}"] = n
        for reason, n in sorted(self.load_failures.items()):
            out[f"remote_kv_load_failures_{reason}"] = n
        return out


@dataclass
class BudgetStats:
    """The L0 budget the budget controller moves (engine/budget_controller.py)."""

    L0_budget_bytes: int
    L0_budget_slots: int
    L0_budget_max_bytes: int
    L0_budget_min_bytes: int
    budget_adjustments_down: int
    budget_adjustments_up: int
    L0_read_share: float
    device_utilization: float | None = None  # the utilization it read last, once it has read one


@dataclass
class ContiguousStats:
    """The contiguous (exact baseline) cache: one buffer per sequence."""

    kv_bytes_used: int
    kv_bytes_allocated: int


@dataclass
class KVStats:
    """One snapshot of a KV cache: sequences, every level in order, and the parts it runs."""

    num_sequences: int
    num_tokens: int
    levels: list[LevelStats] = field(default_factory=list)  # in order; none if contiguous
    selection: SelectionStats | None = None
    moves: list[Move] = field(default_factory=list)
    prefix: PrefixStats | None = None
    persist: PersistStats | None = None
    prefetch: PrefetchStats | None = None
    staging: StagingStats | None = None
    locality: LocalityStats | None = None
    remote: RemoteStats | None = None  # remote_kv_url: the shared level
    budget: BudgetStats | None = None  # set by the engine when a budget controller runs
    contiguous: ContiguousStats | None = None

    def level(self, label: str) -> LevelStats | None:
        """The level called `label` ("L0", ...), or None when the cache has none by that name."""
        return next((lv for lv in self.levels if lv.label == label), None)

    def as_dict(self) -> dict[str, Number]:
        """The public flat form (engine.stats()): the keys users read, in their usual order."""
        out: dict[str, Number] = {"num_sequences": self.num_sequences,
                                  "num_tokens": self.num_tokens}
        if self.contiguous is not None:
            out.update(_present(self.contiguous))
        levels = [(lv.label, lv) for lv in self.levels]
        for label, lv in levels:
            for name in _OCCUPANCY:
                out[f"{label}_{name}"] = getattr(lv, name)
        if self.selection is not None:
            out.update(_present(self.selection))
            for label, lv in levels:
                if lv.candidate_blocks is not None:
                    out[f"{label}_candidate_blocks"] = lv.candidate_blocks
                    out[f"{label}_selected_fraction"] = lv.selected_fraction
        for m in self.moves:
            out[f"bytes_moved_{m.route}"] = m.bytes
        for label, lv in levels:
            for key, n in lv.medium.as_dict().items():
                out[f"{label}_{key}"] = n
        if self.prefix is not None:
            out.update(self.prefix.as_dict())
            for label, lv in levels:
                out[f"{label}_prefix_hit_blocks"] = lv.prefix_hit_blocks
                out[f"{label}_prefix_evicted_blocks"] = lv.prefix_evicted_blocks
        for part in (self.persist, self.prefetch, self.staging, self.locality, self.budget):
            if part is not None:
                out.update(_present(part))
        if self.remote is not None:
            out.update(self.remote.as_dict())
        return out
