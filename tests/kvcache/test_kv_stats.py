"""KVStats: the typed snapshot the metrics, the stats line and the tools read, and the flat dict
users read from engine.stats(), whose keys do not change."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from flashmemory import FlashMemoryEngine
from flashmemory.kvcache.kv_stats import (BudgetStats, LocalityStats, PersistStats, PrefetchStats,
                                          RemoteStats, StagingStats)
from flashmemory.kvcache.tiered import TieredKVCache
from flashmemory.serve.metrics import (LOCALITY_SERIES, PREFETCH_SERIES, PREFIX_SERIES,
                                       REMOTE_SERIES, SELECTION_SERIES, STAGING_SERIES,
                                       ServerMetrics)
from tests.kvcache.synthetic import SyntheticSequence, tiny_config

P = "flashmemory:"
# engine.stats() of a default engine after one request, key for key and in order: what users and
# their
# dashboards read. A change here is a change of the public API.
DEFAULT_ENGINE_KEYS = [
    'num_sequences', 'num_tokens', 'L0_blocks', 'L0_blocks_total', 'L0_bytes', 'L0_bytes_capacity',
    'L0_cached_blocks', 'L0_cached_bytes', 'L1_blocks', 'L1_blocks_total', 'L1_bytes',
    'L1_bytes_capacity', 'L1_cached_blocks', 'L1_cached_bytes', 'L2_blocks', 'L2_blocks_total',
    'L2_bytes', 'L2_bytes_capacity', 'L2_cached_blocks', 'L2_cached_bytes', 'selection_steps',
    'selection_old_read_fraction', 'selection_old_keys_read_fraction', 'selection_ms_per_step',
    'selection_digest_bytes_per_token',
    'selection_digest_bytes', 'L1_candidate_blocks', 'L1_selected_fraction', 'L2_candidate_blocks',
    'L2_selected_fraction', 'bytes_moved_L0->L1', 'bytes_moved_L1->L2', 'bytes_moved_new->L0',
    'bytes_moved_new->L1', 'L0_bytes_committed', 'L0_bytes_allocated', 'L1_bytes_committed',
    'L2_bytes_read', 'L2_load_failures_missing', 'L2_load_failures_truncated',
    'L2_load_failures_checksum', 'L2_load_failures_header', 'L2_write_failures_full',
    'L2_write_failures_io', 'L2_bytes_committed', 'L2_bytes_reclaimable', 'L2_bytes_reclaimed',
    'L2_file_recreated', 'L2_files_refused',
    'L2_failed', 'prefix_cache_queries', 'prefix_cache_hits', 'prefix_cache_hit_rate',
    'prefix_cache_blocks', 'prefix_cache_unused_blocks', 'prefix_cache_lossy_refusals',
    'prefix_cache_bad_blocks', 'L0_prefix_hit_blocks', 'L0_prefix_evicted_blocks',
    'L1_prefix_hit_blocks', 'L1_prefix_evicted_blocks', 'L2_prefix_hit_blocks',
    'L2_prefix_evicted_blocks', 'weights_bytes',
]


def test_engine_stats_keys_are_unchanged(tiny_llama, tmp_path):
    engine = FlashMemoryEngine(model_path=str(tiny_llama), cold_zone_dir=str(tmp_path))
    try:
        engine.generate_token_ids(list(range(5, 40)), max_new_tokens=4, ignore_eos=True)
        assert list(engine.stats()) == DEFAULT_ENGINE_KEYS
        # The cache's own, as the request ended.
        assert list(engine.last_kv_stats) == DEFAULT_ENGINE_KEYS[:-1]
        assert engine.last_kv_snapshot.as_dict() == engine.last_kv_stats
    finally:
        engine.close()


def _every_part(tmp_path):
    """A real cache's snapshot after L2 was reached, with every optional part filled with distinct
    figures."""
    cache = TieredKVCache(tiny_config(cold_zone_dir=str(tmp_path)))
    try:
        cache.add_sequence(0)
        seq = SyntheticSequence(0, 80)
        seq.forward(cache, 0, 64)
        for t in range(64, 80):
            seq.forward(cache, t, t + 1)
        stats = cache.kv_stats()
    finally:
        cache.close()

    def numbered(cls):
        return cls(**{f.name: i + 1 for i, f in enumerate(dataclasses.fields(cls))})

    stats.prefetch, stats.staging = numbered(PrefetchStats), numbered(StagingStats)
    stats.persist, stats.budget = numbered(PersistStats), numbered(BudgetStats)
    stats.locality = numbered(LocalityStats)
    stats.remote = RemoteStats(1, 2, 3, 4, 5, 6, 1, publish_skipped={"queue": 7},
                               load_failures={"checksum": 8})
    return stats


def _exposition(stats) -> dict:
    metrics = ServerMetrics("tiny")
    metrics.publish_kv(stats)
    text = generate_latest(metrics.registry).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_every_metric_series_reads_a_typed_stat(tmp_path):
    stats = _every_part(tmp_path)
    m = _exposition(stats)
    for table, record in ((PREFIX_SERIES, stats.prefix), (PREFETCH_SERIES, stats.prefetch),
                          (STAGING_SERIES, stats.staging), (SELECTION_SERIES, stats.selection),
                          (LOCALITY_SERIES, stats.locality), (REMOTE_SERIES, stats.remote)):
        for entry in table:
            assert entry.key in {f.name for f in dataclasses.fields(record)}, entry.key
            (sample,) = m[P + entry.key].samples
            assert sample.value == float(getattr(record, entry.key)), entry.key
    labels = [lv.label for lv in stats.levels]
    for name in ("kv_cache_usage_perc", "kv_blocks", "kv_blocks_capacity", "kv_bytes",
                 "kv_bytes_capacity", "kv_cached_blocks", "kv_bytes_committed",
                 "prefix_cache_hit_blocks", "prefix_cache_evicted_blocks"):
        tiers = [s.labels["tier"] for s in m[P + name].samples if not s.name.endswith("_created")]
        assert tiers == labels, name
    blocks = {s.labels["tier"]: s.value for s in m[P + "kv_blocks"].samples}
    assert blocks == {lv.label: lv.blocks for lv in stats.levels}
    moved = {(s.labels["source"], s.labels["tier"]): s.value
             for s in m[P + "kv_bytes_moved"].samples if s.name.endswith("_total")}
    assert moved == {(mv.source, mv.dest): mv.bytes for mv in stats.moves}
    assert {s.labels["tier"] for s in m[P + "kv_selected_fraction"].samples} == {"L1", "L2"}
    reasons = {s.labels["reason"] for s in m[P + "kv_load_failures"].samples}
    assert reasons == {"missing", "truncated", "checksum", "header"}
    remote = {(s.labels["tier"], s.labels["reason"]): s.value
              for s in m[P + "kv_load_failures"].samples if s.name.endswith("_total")}
    assert remote[("remote", "checksum")] == 8
    (skipped,) = [s for s in m[P + "remote_kv_publish_skipped"].samples
                  if s.name.endswith("_total")]
    assert skipped.labels == {"model_name": "tiny", "tier": "remote", "reason": "queue"}
    assert skipped.value == 7
    flat = stats.as_dict()
    assert flat["remote_kv_publish_skipped_queue"] == 7
    assert flat["remote_kv_load_failures_checksum"] == 8
    budget = next(s for s in m[P + "kv_budget_bytes"].samples)
    assert budget.value == stats.budget.L0_budget_bytes
    assert m[P + "device_utilization"].samples[0].value == stats.budget.device_utilization


@pytest.mark.parametrize("part, field", [("prefetch", "prefetch_hits"),
                                         ("staging", "device_staging_bytes"),
                                         ("budget", "L0_read_share")])
def test_a_renamed_stats_field_fails_the_metrics_instead_of_dropping_a_series(tmp_path, part,
                                                                             field):
    stats = _every_part(tmp_path)
    fields = dataclasses.asdict(getattr(stats, part))
    fields[field + "_renamed"] = fields.pop(field)
    setattr(stats, part, SimpleNamespace(**fields))
    with pytest.raises(AttributeError, match=field):
        _exposition(stats)


def test_the_flat_form_is_every_typed_figure_under_its_public_name(tmp_path):
    stats = _every_part(tmp_path)
    flat = stats.as_dict()
    for lv in stats.levels:
        assert flat[f"{lv.label}_blocks"] == lv.blocks and flat[f"{lv.label}_bytes"] == lv.bytes
        assert flat[f"{lv.label}_prefix_hit_blocks"] == lv.prefix_hit_blocks
    assert flat["prefetch_hits"] == stats.prefetch.prefetch_hits
    assert flat["L0_budget_bytes"] == stats.budget.L0_budget_bytes
    assert flat["persist_records_recovered"] == stats.persist.persist_records_recovered
    assert flat["L2_load_failures_checksum"] == stats.level("L2").medium.load_failures["checksum"]
