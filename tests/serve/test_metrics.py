"""/metrics parses with prometheus_client's parser and carries vLLM-named request metrics, per-tier KV series and,
when the cache runs an L2 prefetcher, its figures."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from flashmemory import FlashMemoryEngine
from flashmemory.kvcache.kv_stats import (KVStats, LevelStats, MediumCounters, PrefetchStats,
                                          StagingStats)
from flashmemory.serve.metrics import PREFETCH_SERIES, STAGING_SERIES, ServerMetrics
from flashmemory.serve.stats_log import StatsLogger

P = "flashmemory:"


def scrape(http) -> dict:
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def value(family, **labels) -> float:
    return next(s.value for s in family.samples if all(s.labels.get(k) == v for k, v in labels.items())
                and s.name in (family.name, family.name + "_total"))


def test_metrics_parse_and_show_requests_tokens_latencies_and_every_tier(http):
    before = scrape(http)
    r = http.post("/v1/completions", json={"prompt": "Alice was beginning", "max_tokens": 90, "ignore_eos": True})
    assert r.status_code == 200
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    m = scrape(http)
    p = "flashmemory:"
    assert value(m[p + "generation_tokens"]) - value(before[p + "generation_tokens"]) == 90
    assert value(m[p + "prompt_tokens"]) - value(before[p + "prompt_tokens"]) == prompt_tokens
    assert value(m[p + "request_success"], finished_reason="length") >= 1
    assert value(m[p + "num_requests_running"]) == 0 and value(m[p + "num_requests_waiting"]) == 0
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert m[p + name].type == "histogram"
        assert next(s.value for s in m[p + name].samples if s.name.endswith("_count")) > 0
    assert {s.labels["kind"] for s in m[p + "num_preemptions"].samples} >= {"demote", "recompute"}
    # Per-level series with a `tier` label.
    for name in ("kv_cache_usage_perc", "kv_blocks", "kv_blocks_capacity", "kv_bytes", "kv_bytes_capacity"):
        assert {s.labels["tier"] for s in m[p + name].samples} == {"L0", "L1", "L2"}, name
    assert value(m[p + "kv_blocks_capacity"], tier="L0") > 0
    assert 0 <= value(m[p + "kv_cache_usage_perc"], tier="L1") <= 1
    assert {s.labels["tier"] for s in m[p + "kv_selected_fraction"].samples} == {"L1", "L2"}
    moved = {(s.labels["source"], s.labels["tier"]): s.value for s in m[p + "kv_bytes_moved"].samples}
    # 90 tokens past a 32-token window and a 32-token warm span: blocks went new->L0/L1, L0->L1 and L1->L2.
    assert all(moved[route] > 0 for route in (("new", "L0"), ("new", "L1"), ("L0", "L1"), ("L1", "L2")))
    assert {s.labels["reason"] for s in m[p + "kv_load_failures"].samples} == {"missing", "truncated", "checksum",
                                                                             "header"}
    assert value(m[p + "kv_blocks"], tier="L2") == 0  # the finished request's blocks are freed
    # The prefix cache: queries and hits in tokens, per-tier hits, cached blocks (free for the taking).
    assert value(m[p + "prefix_cache_queries"]) >= prompt_tokens and p + "prefix_cache_hits" in m
    assert {s.labels["tier"] for s in m[p + "prefix_cache_hit_blocks"].samples} == {"L0", "L1", "L2"}
    assert value(m[p + "kv_cached_blocks"], tier="L1") >= 0
    # What the OS committed to each level stays after the request (the working set), and faults are counted.
    assert value(m[p + "kv_bytes_committed"], tier="L1") > 0 and value(m[p + "kv_bytes_committed"], tier="L2") > 0
    assert {s.labels["action"] for s in m[p + "sequence_faults"].samples} == {"recompute", "fail"}
    # No prefetcher in this server: no prefetch series (rather than zeros claiming one that never hits).
    assert not [name for name in m if name.startswith((p + "prefetch_", p + "device_staging_"))]


def exposition(stats: KVStats) -> dict:
    """/metrics' text for a server whose engine thread published `stats`, parsed."""
    metrics = ServerMetrics("tiny")
    metrics.publish_kv(stats)
    return {f.name: f for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())}


def test_prefetch_series_carry_a_real_prefetching_cache_stats(tiny_llama):
    # The tiny model with a 32-token window and 32-token warm span: 96 prompt tokens put blocks on L2, and the
    # decode steps read them through the prefetcher.
    engine = FlashMemoryEngine(model_path=str(tiny_llama), num_threads=1, block_size=8, active_window=32,
                               warm_tokens=32, prefill_chunk_tokens=64, cpu_memory_gb=0.01, cold_zone_gb=0.01,
                               max_num_seqs=1, prefetch_strategy="adaptive", prefetch_ranker="predictor",
                               cold_zone_uncached_reads=True)
    try:
        engine.generate_token_ids(list(range(5, 101)), max_new_tokens=24, ignore_eos=True)
        snapshot = engine.last_kv_snapshot
    finally:
        engine.close()
    prefetch = snapshot.prefetch
    # Decode steps read L2 through the prefetcher.
    assert prefetch.prefetch_hits + prefetch.prefetch_misses > 0
    m = exposition(snapshot)
    for e in PREFETCH_SERIES:
        family = m[P + e.key]
        assert family.type == e.kind, e.key
        (sample,) = family.samples
        assert sample.name == P + e.key + ("_total" if e.kind == "counter" else "")
        assert sample.labels == {"model_name": "tiny"}
        flat = engine.last_kv_stats[e.key]
        assert sample.value == float(getattr(prefetch, e.key)) == float(flat), e.key
    assert 0 <= value(m[P + "prefetch_hit_rate"]) <= 1
    # No device staging in this cache: none of its series.
    assert not [e.key for e in STAGING_SERIES if P + e.key in m]


def _levels(*figures: tuple[int, int]) -> list[LevelStats]:
    """Levels L0, L1, ... holding (bytes, capacity) each."""
    return [LevelStats(i, "level", 1, 10, used, cap, 0, 0, MediumCounters())
            for i, (used, cap) in enumerate(figures)]


def test_prefetch_series_follow_the_snapshot_parts_predictor_seconds_and_device_staging_included():
    kv = KVStats(1, 8, levels=_levels((10, 100)))
    m = exposition(kv)
    assert not [name for name in m if name.startswith((P + "prefetch_", P + "device_staging_"))]
    kv.prefetch = PrefetchStats(
        prefetch_issued=7, prefetch_completed=6, prefetch_hits=30, prefetch_misses=10,
        prefetch_late_misses=2, prefetch_hits_prefetched=20, prefetch_wasted_bytes=4096,
        prefetch_dropped_races=0, prefetch_predictor_calls=3, prefetch_staged_bytes=2048,
        prefetch_hit_rate=0.75, prefetch_predictor_seconds=0.125, prefetch_ranking_seconds=0.25,
        predictor_ms=1.0, prefetch_ranking_ms=2.0, prefetch_depth=1.5)
    kv.staging = StagingStats(device_staging_issued=8, device_staging_hits=5,
                              device_staging_misses=3, device_staging_wasted_bytes=0,
                              device_staging_bytes=512, device_staging_capacity_bytes=4096)
    m = exposition(kv)
    assert value(m[P + "prefetch_issued"]) == 7 and value(m[P + "prefetch_wasted_bytes"]) == 4096
    assert value(m[P + "prefetch_hits"]) == 30 and value(m[P + "prefetch_misses"]) == 10
    assert value(m[P + "prefetch_predictor_seconds"]) == 0.125 and m[P + "prefetch_predictor_seconds"].type == "counter"
    assert value(m[P + "prefetch_hit_rate"]) == 0.75 and m[P + "prefetch_hit_rate"].type == "gauge"
    assert value(m[P + "prefetch_staged_bytes"]) == 2048 and value(m[P + "prefetch_depth"]) == 1.5
    assert value(m[P + "device_staging_hits"]) == 5 and value(m[P + "device_staging_misses"]) == 3
    assert value(m[P + "device_staging_bytes"]) == 512 and m[P + "device_staging_bytes"].type == "gauge"


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_stats_line_reports_throughput_and_usage_and_stays_quiet_when_idle(caplog):
    caplog.set_level("INFO", logger="flashmemory.serve.stats_log")
    clock = FakeClock()
    stats = StatsLogger(interval_s=10, clock=clock)
    kv = KVStats(2, 100, levels=_levels((25, 100), (1, 1000), (0, 10)))
    stats.record(prompt_tokens=100, generation_tokens=50)
    clock.now = 5
    assert stats.maybe_log(2, 1, kv) is None  # not yet due
    clock.now = 10
    line = stats.maybe_log(2, 1, kv)
    assert line is not None and line in caplog.text
    for part in ("prompt throughput 10.0 tokens/s", "generation throughput 5.0 tokens/s", "running 2", "waiting 1",
                 "L0 25.0%", "L1 0.1%", "L2 0.0%"):
        assert part in line
    clock.now = 30
    assert stats.maybe_log(0, 0, kv) is None  # idle: nothing happened and nothing waits
    assert stats.maybe_log(0, 0, kv) is None
    clock.now = 45
    assert stats.maybe_log(0, 3, kv) is not None  # something waits: report it


def test_a_conversation_s_next_turn_reuses_its_history_through_the_server(http):
    # The tiny model has no chat template: a completion whose prompt grows turn by turn is the same path. The first
    # turn stays within window + warm (64 tokens), so none of its blocks ages into INT2 L2: a prefix ending among such
    # blocks is computed again, not reused (docs/prefix_cache.md).
    history = "You are a careful reader. Q: who is Alice? A:"
    first = http.post("/v1/completions", json={"prompt": history, "max_tokens": 6, "ignore_eos": True})
    assert first.status_code == 200
    before = scrape(http)
    history += first.json()["choices"][0]["text"] + " Q: and the Rabbit? A:"
    second = http.post("/v1/completions", json={"prompt": history, "max_tokens": 6, "ignore_eos": True})
    assert second.status_code == 200
    after = scrape(http)
    hits = value(after[P + "prefix_cache_hits"]) - value(before[P + "prefix_cache_hits"])
    queries = value(after[P + "prefix_cache_queries"]) - value(before[P + "prefix_cache_queries"])
    assert queries == second.json()["usage"]["prompt_tokens"]
    assert hits >= 32  # the first turn's full blocks were not prefilled again
