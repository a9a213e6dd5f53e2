"""The budget controller's figures on /metrics: flashmemory:kv_budget_bytes{tier="L0"} and the adjustments by
direction, from the snapshot the engine thread publishes (and absent when no controller runs)."""

from __future__ import annotations

import httpx
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from flashmemory.kvcache.kv_stats import BudgetStats, KVStats
from flashmemory.serve.metrics import ServerMetrics
from tests.serve.conftest import TINY_KV, live_server

P = "flashmemory:"


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def sample(family, **labels) -> float:
    return next(s.value for s in family.samples if all(s.labels.get(k) == v for k, v in labels.items()))


def test_the_budget_series_follow_the_snapshot():
    metrics = ServerMetrics("m")
    budget = BudgetStats(L0_budget_bytes=90 * 2**20, L0_budget_slots=90,
                         L0_budget_max_bytes=100 * 2**20, L0_budget_min_bytes=2**20,
                         budget_adjustments_down=2, budget_adjustments_up=1, L0_read_share=0.6,
                         device_utilization=0.25)
    metrics.publish_kv(KVStats(1, 24, budget=budget))
    m = families(generate_latest(metrics.registry).decode())
    assert sample(m[P + "kv_budget_bytes"], tier="L0", model_name="m") == 90 * 2**20
    assert m[P + "kv_budget_adjustments"].type == "counter"
    assert sample(m[P + "kv_budget_adjustments"], direction="down") == 2
    assert sample(m[P + "kv_budget_adjustments"], direction="up") == 1
    assert sample(m[P + "kv_l0_read_share"]) == 0.6 and sample(m[P + "device_utilization"]) == 0.25


def test_no_controller_no_budget_series():
    metrics = ServerMetrics("m")
    metrics.publish_kv(KVStats(1, 24))
    assert P + "kv_budget_bytes" not in families(generate_latest(metrics.registry).decode())


def test_a_server_with_the_controller_exports_its_budget(tiny_llama):
    kwargs = dict(model_path=str(tiny_llama), **TINY_KV, budget_controller=True)
    with live_server(kwargs, served_model_name="tiny") as server:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            r = http.post("/v1/completions", json={"prompt": "Alice was", "max_tokens": 20, "ignore_eos": True})
            assert r.status_code == 200
            m = families(http.get("/metrics").text)
    controller = server.worker.engine.budget_controller
    expected = controller.actuator.limit_slots * controller.actuator.slot_bytes
    assert sample(m[P + "kv_budget_bytes"], tier="L0") == expected
    assert sample(m[P + "kv_budget_adjustments"], direction="down") == 0
