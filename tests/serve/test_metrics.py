"""/metrics parses with prometheus_client's parser and carries vLLM-named request metrics and per-tier KV series."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from flashmemory.serve.stats_log import StatsLogger


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


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_stats_line_reports_throughput_and_usage_and_stays_quiet_when_idle(caplog):
    caplog.set_level("INFO", logger="flashmemory.serve.stats_log")
    clock = FakeClock()
    stats = StatsLogger(interval_s=10, clock=clock)
    kv = {"L0_bytes": 25, "L0_bytes_capacity": 100, "L1_bytes": 1, "L1_bytes_capacity": 1000,
          "L2_bytes": 0, "L2_bytes_capacity": 10}
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
