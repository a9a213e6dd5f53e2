"""ServerMetrics: the server's Prometheus registry (`flashmemory:` prefix, vLLM's names where the meaning is the same).

Request metrics are updated by the engine thread as tokens are sampled; the KV levels are exported per `tier`
(each level's label: L0 device, L1 host, L2 disk by default) from the latest `cache.kv_stats()`
snapshot the engine thread publishes each step, and so are the prefetcher's figures when the cache
runs one (PREFETCH_SERIES). Every series reads an attribute of the typed snapshot
(kvcache/kv_stats.py): a renamed field fails here, it does not drop a series.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from flashmemory.engine.speculative.speculator import SpecStats
from flashmemory.guardrail.classifier import RESULTS
from flashmemory.kvcache.kv_stats import KVStats, MediumCounters

PREFIX = "flashmemory:"
# vLLM's buckets for the same histograms.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
# A guardrail check takes about a millisecond (the BiLSTM) to a timeout of tens of ms.
GUARDRAIL_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)


@dataclass(frozen=True)
class StatSeries:
    """One field of a KVStats part exported as one series named PREFIX + field (labelled by
    model_name only)."""

    key: str  # the field, and the metric name after PREFIX (a counter's exposition adds `_total`)
    kind: str  # "counter" (cumulative since the prefetcher started) or "gauge"
    doc: str


# The prefetcher's figures (DESIGN.md §prefetch), fields of PrefetchStats; a series exists only
# when the snapshot has the part: a cache without a prefetcher exports none (zeros would claim a
# prefetcher that never hits).
PREFETCH_SERIES = (
    StatSeries("prefetch_issued", "counter", "L2 segment reads the prefetcher queued"),
    StatSeries("prefetch_completed", "counter", "Prefetched L2 segments read, verified and staged in host memory"),
    StatSeries("prefetch_hits", "counter", "L2 segment reads served from the prefetch staging area"),
    StatSeries("prefetch_hits_prefetched", "counter",
               "Of the hits, segments a prefetch reader read ahead (the rest were kept from the step's own reads)"),
    StatSeries("prefetch_misses", "counter", "L2 segment reads that went to the disk"),
    StatSeries("prefetch_late_misses", "counter",
               "Of the misses, segments a prefetch reader had queued or in flight (the disk was behind)"),
    StatSeries("prefetch_wasted_bytes", "counter", "Bytes prefetched from L2 and dropped unread"),
    StatSeries("prefetch_predictor_seconds", "counter",
               "Seconds the ranker itself ran (heat predictor MLP or LRU formula)"),
    StatSeries("prefetch_ranking_seconds", "counter",
               "Seconds of prefetch work at the end of decode steps (statistics, features, ranking, wanted sets)"),
    StatSeries("prefetch_hit_rate", "gauge",
               "Fraction of L2 segment reads served from the staging area since the prefetcher started (0-1)"),
    StatSeries("prefetch_staged_bytes", "gauge", "Bytes staged by the prefetcher now"),
    StatSeries("prefetch_depth", "gauge",
               "Prefetch depth now (blocks ranked per block a step selects; the adaptive strategy moves it)"),
)
# Device staging of warm (L1) blocks ahead of the step that reads them, counted per (block, layer,
# KV head).
STAGING_SERIES = (
    StatSeries("device_staging_issued", "counter", "L1 block records the device staging area was asked to copy ahead"),
    StatSeries("device_staging_hits", "counter", "L1 block reads served from the device staging area"),
    StatSeries("device_staging_misses", "counter", "L1 block reads copied from host memory on demand (not staged)"),
    StatSeries("device_staging_wasted_bytes", "counter", "Bytes staged on the device and dropped unread"),
    StatSeries("device_staging_bytes", "gauge", "Bytes of the device staging area in use now"),
    StatSeries("device_staging_capacity_bytes", "gauge", "Bytes of the device staging area"),
)

# Placement by access locality (placement_policy="locality"), fields of LocalityStats.
LOCALITY_SERIES = (
    StatSeries("locality_raised_to_device", "counter",
               "Old KV blocks placement by locality gave an L0 copy (selection kept choosing "
               "them)"),
    StatSeries("locality_raised_to_host", "counter",
               "KV blocks placement by locality brought back to L1 from a level below"),
    StatSeries("locality_sunk", "counter",
               "KV blocks that left L1 early: no decode step chose them over a full history"),
    StatSeries("locality_deferred", "counter",
               "Locality placement updates held back while the link was saturated"),
    StatSeries("link_utilization", "gauge",
               "The KV moves' share of the host-device link's measured rate, last measured (0-1)"),
)

# The prefix cache's figures (vLLM's names for queries and hits, counted in tokens), fields of
# PrefixStats.
PREFIX_SERIES = (
    StatSeries("prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache"),
    StatSeries("prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache (their prefill was skipped)"),
    StatSeries("prefix_cache_hit_rate", "gauge", "Hits over queries since the engine started (0-1)"),
    StatSeries("prefix_cache_blocks", "gauge", "Named blocks the prefix cache holds (in use or not)"),
    StatSeries("prefix_cache_unused_blocks", "gauge",
               "Named blocks no request uses (free for the taking)"),
    StatSeries("prefix_cache_lossy_refusals", "counter",
               "Matches cut short at a block whose FP16 master was lost (computed again instead)"),
    StatSeries("prefix_cache_bad_blocks", "counter",
               "Cached blocks dropped because a reuse could not read them"),
)

# Query-aware selection over the levels below L0, fields of SelectionStats.
SELECTION_SERIES = (
    StatSeries("selection_steps", "counter",
               "Decode steps that chose among old (L1 and below) blocks"),
    StatSeries("selection_old_read_fraction", "gauge",
               "Old blocks decode steps attended, over those held (since the start, 0-1)"),
    StatSeries("selection_old_keys_read_fraction", "gauge",
               "Old blocks whose keys decode steps read (attended, or scored by a two-pass read)"),
    StatSeries("selection_ms_per_step", "gauge",
               "Milliseconds a decode step spends choosing blocks"),
    StatSeries("selection_digest_bytes", "gauge",
               "Host bytes of the live sequences' selection digests"),
)


# The shared level (remote_kv_url), fields of RemoteStats; its values not served are in
# kv_load_failures under tier="remote".
REMOTE_SERIES = (
    StatSeries("remote_kv_lookups", "counter",
               "Prompts looked up in the shared KV level past their local prefix"),
    StatSeries("remote_kv_hit_blocks", "counter",
               "KV blocks read from the shared level instead of computed"),
    StatSeries("remote_kv_miss_blocks", "counter",
               "Shared-level lookups that ended at a block it did not hold (or not believably)"),
    StatSeries("remote_kv_published_blocks", "counter", "KV blocks this replica published"),
    StatSeries("remote_kv_existing_blocks", "counter",
               "KV blocks another replica had published first"),
    StatSeries("remote_kv_network_failures", "counter",
               "Calls to the shared level that timed out or lost the connection"),
    StatSeries("remote_kv_available", "gauge",
               "1 when the shared level answered the last call; 0 when it did not"),
)


# Speculative decoding (vLLM's spec_decode names), fields of SpecStats; exported only when the
# engine drafts.
SPEC_SERIES = (
    StatSeries("spec_decode_num_drafts", "counter", "Verification forwards that carried drafts"),
    StatSeries("spec_decode_draft_tokens", "counter", "Tokens drafted"),
    StatSeries("spec_decode_accepted_tokens", "counter", "Drafted tokens the target kept"),
    StatSeries("spec_decode_emitted_tokens", "counter",
               "Tokens verifications produced (kept drafts and the target's own)"),
    StatSeries("spec_decode_fallbacks", "counter",
               "Sequences whose drafting failed; they went on decoding without drafts"),
    StatSeries("spec_decode_paused_steps", "counter",
               "Decode steps left without drafts because the measured costs said plain decoding "
               "was faster (speculative_cost_aware)"),
    StatSeries("spec_decode_acceptance_rate", "gauge",
               "Kept over drafted tokens since start (0-1)"),
)


class _KVCollector(Collector):
    """Exports the KV levels from the latest stats snapshot (replaced whole, so reads need no
    lock)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.snapshot: KVStats | None = None
        self.spec: SpecStats | None = None  # None: the engine does not draft

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot
        if s is None:
            return
        labels = ["model_name", "tier"]

        def family(kind, name: str, doc: str, extra: list[str] | None = None):
            cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            return cls(PREFIX + name, doc, labels=labels + (extra or []))

        usage = family("gauge", "kv_cache_usage_perc", "KV usage of each level (fraction of its capacity, 0-1)")
        blocks = family("gauge", "kv_blocks", "KV blocks held on each level")
        blocks_total = family("gauge", "kv_blocks_capacity", "KV blocks each level can hold")
        nbytes = family("gauge", "kv_bytes", "KV bytes held on each level (L0 includes the newest, unquantized blocks)")
        capacity = family("gauge", "kv_bytes_capacity", "KV bytes each level can hold (the current budget)")
        selected = family("gauge", "kv_selected_fraction",
                          "Fraction of a level's candidate blocks that decode steps attended (query-aware selection)")
        moved = family("counter", "kv_bytes_moved", "KV bytes written into a level, by source level ('new' = fresh KV)",
                       ["source"])
        read = family("counter", "kv_bytes_read", "KV bytes read back from a level's storage")
        cached = family("gauge", "kv_cached_blocks", "Blocks of each level that only the prefix cache holds (no request "
                        "uses them; counted as free: evicted, least recently used first, when room is needed)")
        prefix_hits = family("counter", "prefix_cache_hit_blocks", "Blocks reused from the prefix cache, by the level "
                             "their fastest copy was on")
        prefix_evicted = family("counter", "prefix_cache_evicted_blocks", "Copies of cached blocks dropped from each "
                                "level to make room")
        committed = family("gauge", "kv_bytes_committed", "Memory or disk the OS has committed to a level so far "
                           "(host pages touched, the sparse cold file's allocated blocks); stays at the working set")
        reclaimable = family("gauge", "kv_bytes_reclaimable", "Disk a level's file holds for "
                             "records freed since they were written; idle-time compaction gives it "
                             "back (kvcache/levels/compaction.py)")
        fragmentation = family("gauge", "kv_fragmentation", "Of the disk a level's file takes, the "
                               "fraction that holds freed records (0-1); compaction brings it to 0")
        reclaimed = family("counter", "kv_bytes_reclaimed", "Disk compaction gave back from a "
                           "level's file")
        failures = family("counter", "kv_load_failures", "Blocks that failed to load from a level, by reason",
                          ["reason"])
        for level in s.levels:
            lv = [self.model_name, level.label]
            blocks.add_metric(lv, level.blocks)
            blocks_total.add_metric(lv, level.blocks_total)
            nbytes.add_metric(lv, level.bytes)
            capacity.add_metric(lv, level.bytes_capacity)
            usage.add_metric(lv, level.usage)
            if level.selected_fraction is not None:
                selected.add_metric(lv, level.selected_fraction)
            medium: MediumCounters = level.medium
            for reason, n in (medium.load_failures or {}).items():
                failures.add_metric(lv + [reason], n)
            if medium.bytes_read is not None:
                read.add_metric(lv, medium.bytes_read)
            if medium.bytes_committed is not None:
                committed.add_metric(lv, medium.bytes_committed)
            if medium.bytes_reclaimable is not None:
                reclaimable.add_metric(lv, medium.bytes_reclaimable)
                reclaimed.add_metric(lv, medium.bytes_reclaimed or 0)
                taken = medium.bytes_committed or 0
                share = min(1.0, medium.bytes_reclaimable / taken) if taken else 0.0
                fragmentation.add_metric(lv, share)
            cached.add_metric(lv, level.cached_blocks)
            if level.prefix_hit_blocks is not None:
                prefix_hits.add_metric(lv, level.prefix_hit_blocks)
                prefix_evicted.add_metric(lv, level.prefix_evicted_blocks)
        for move in s.moves:
            moved.add_metric([self.model_name, move.dest, move.source], move.bytes)
        skipped = family("counter", "remote_kv_publish_skipped", "KV blocks not published to "
                         "the shared level, by reason (down, cap, full, queue)", ["reason"])
        if s.remote is not None:
            for reason, n in s.remote.load_failures.items():
                failures.add_metric([self.model_name, "remote", reason], n)
            for reason, n in s.remote.publish_skipped.items():
                skipped.add_metric([self.model_name, "remote", reason], n)
        yield from (usage, blocks, blocks_total, nbytes, capacity, selected, moved, read, failures,
                    committed, cached, reclaimable, fragmentation, reclaimed)
        if s.prefix is not None:
            yield from (prefix_hits, prefix_evicted)
        yield from self._series(s.prefix, PREFIX_SERIES)
        yield from self._series(s.selection, SELECTION_SERIES)
        yield from self._series(s.prefetch, PREFETCH_SERIES)
        yield from self._series(s.staging, STAGING_SERIES)
        yield from self._series(s.locality, LOCALITY_SERIES)
        if s.remote is not None:
            yield skipped
        yield from self._series(s.remote, REMOTE_SERIES)
        yield from self._series(self.spec, SPEC_SERIES)
        yield from self._budget()

    def _budget(self) -> Iterator[Metric]:
        """The L0 budget the DynamicBudgetController sets, its adjustments and its inputs (when it runs)."""
        b = self.snapshot.budget if self.snapshot is not None else None
        if b is None:
            return
        budget = GaugeMetricFamily(PREFIX + "kv_budget_bytes", "KV bytes a level may hold now (the L0 budget the "
                                   "budget controller moves within max_gpu_memory_mb)", labels=["model_name", "tier"])
        budget.add_metric([self.model_name, "L0"], b.L0_budget_bytes)
        adjustments = CounterMetricFamily(PREFIX + "kv_budget_adjustments", "Changes of the L0 budget by the budget "
                                          "controller, by direction", labels=["model_name", "direction"])
        adjustments.add_metric([self.model_name, "down"], b.budget_adjustments_down)
        adjustments.add_metric([self.model_name, "up"], b.budget_adjustments_up)
        share = GaugeMetricFamily(PREFIX + "kv_l0_read_share", "Share of the KV blocks decode steps read that L0 "
                                  "served (0-1, since start)", labels=["model_name"])
        share.add_metric([self.model_name], b.L0_read_share)
        yield from (budget, adjustments, share)
        if b.device_utilization is not None:
            util = GaugeMetricFamily(PREFIX + "device_utilization", "Device utilization the budget controller read "
                                     "last (NVML on a GPU, the engine thread's busy fraction on a CPU; 0-1)",
                                     labels=["model_name"])
            util.add_metric([self.model_name], b.device_utilization)
            yield util

    def _series(self, record: object | None, table: tuple[StatSeries, ...]) -> Iterator[Metric]:
        """One family per table entry, read from `record`'s field of that name (nothing without the
        record)."""
        if record is None:
            return
        for entry in table:
            cls = GaugeMetricFamily if entry.kind == "gauge" else CounterMetricFamily
            family = cls(PREFIX + entry.key, entry.doc, labels=["model_name"])
            family.add_metric([self.model_name], float(getattr(record, entry.key)))
            yield family


class ServerMetrics:
    """Owns one server's registry: requests, tokens, latencies, preemptions, and the KV levels."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r, m = self.registry, ["model_name"]
        self.num_requests_running = Gauge(PREFIX + "num_requests_running", "Sequences in the running batch", m,
                                          registry=r).labels(model_name)
        self.num_requests_waiting = Gauge(PREFIX + "num_requests_waiting",
                                          "Sequences waiting to run (queued, or preempted and not yet resumed)", m,
                                          registry=r).labels(model_name)
        self.num_requests_parked = Gauge(PREFIX + "num_requests_parked",
                                         "Sequences preempted by demotion (KV in L1/L2), waiting for room in L0", m,
                                         registry=r).labels(model_name)
        self._preemptions = Counter(PREFIX + "num_preemptions",
                                    "Preemptions: 'demote' moved a sequence out of L0, 'recompute' freed it to be "
                                    "prefilled again", m + ["kind"], registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens prefilled (recomputed ones included)", m,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated", m,
                                         registry=r).labels(model_name)
        self._success = Counter(PREFIX + "request_success", "Finished sequences by reason", m + ["finished_reason"],
                                registry=r)
        self.time_to_first_token = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token", m,
                                             buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.inter_token_latency = Histogram(PREFIX + "inter_token_latency_seconds", "Time between output tokens", m,
                                             buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e_request_latency = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to last token", m,
                                             buckets=E2E_BUCKETS, registry=r).labels(model_name)
        self._faults = Counter(PREFIX + "sequence_faults", "Failures while serving a sequence (a corrupt cold block, a "
                               "full disk, a sampling error): 'recompute' retried it from its tokens, 'fail' ended it "
                               "with an error; other sequences are not affected", m + ["action"], registry=r)
        for action in ("recompute", "fail"):
            self._faults.labels(model_name, action)
        for kind in ("demote", "recompute"):
            self._preemptions.labels(model_name, kind)
        for reason in ("stop", "length", "abort", "error", "content_filter"):
            self._success.labels(model_name, reason)
        self._guardrail_checks = Counter(
            PREFIX + "guardrail_checks", "Guardrail checks of generated text by result: pass, "
            "flagged (the output ended with content_filter), timeout (skipped, not retried), error",
            m + ["result"], registry=r)
        for result in RESULTS:
            self._guardrail_checks.labels(model_name, result)
        self.guardrail_timeouts = Counter(
            PREFIX + "guardrail_timeouts", "Guardrail checks skipped for want of an answer within "
            "guardrail_timeout_ms (also counted as result=timeout above)", m,
            registry=r).labels(model_name)
        self.guardrail_latency = Histogram(
            PREFIX + "guardrail_check_seconds", "Submitted to answered, per answered guardrail "
            "check",
            m, buckets=GUARDRAIL_BUCKETS, registry=r).labels(model_name)
        self._kv = _KVCollector(model_name)
        r.register(self._kv)
        ProcessCollector(registry=r)

    def count_preemption(self, kind: str, n: int = 1) -> None:
        self._preemptions.labels(self.model_name, kind).inc(n)

    def count_fault(self, action: str) -> None:
        self._faults.labels(self.model_name, action).inc()

    def count_finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def count_guardrail(self, result: str, latency_s: float) -> None:
        self._guardrail_checks.labels(self.model_name, result).inc()
        if result == "timeout":
            self.guardrail_timeouts.inc()
        else:
            self.guardrail_latency.observe(latency_s)

    def publish_kv(self, stats: KVStats, spec: SpecStats | None = None) -> None:
        self._kv.snapshot = stats
        self._kv.spec = None if spec is None else dataclasses.replace(spec)  # a copy of the counts
