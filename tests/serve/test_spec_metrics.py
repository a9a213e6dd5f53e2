"""Speculative decoding on /metrics: vLLM's spec_decode counters and the acceptance rate from the
engine's SpecStats, and no such series when the engine does not draft."""

from __future__ import annotations

import httpx
from prometheus_client import generate_latest

from flashmemory.engine.speculative.speculator import SpecStats
from flashmemory.kvcache.kv_stats import KVStats
from flashmemory.serve.metrics import ServerMetrics
from tests.serve.conftest import TINY_KV, live_server
from tests.serve.test_budget_metrics import P, families, sample


def test_the_spec_decode_series_follow_the_engines_counts():
    metrics = ServerMetrics("m")
    spec = SpecStats(spec_decode_num_drafts=5, spec_decode_draft_tokens=20,
                     spec_decode_accepted_tokens=15, spec_decode_emitted_tokens=20,
                     spec_decode_fallbacks=1)
    metrics.publish_kv(KVStats(1, 24), spec)
    spec.spec_decode_draft_tokens = 99  # the engine goes on counting: the published copy stays
    m = families(generate_latest(metrics.registry).decode())
    assert m[P + "spec_decode_draft_tokens"].type == "counter"
    assert sample(m[P + "spec_decode_draft_tokens"], model_name="m") == 20
    assert sample(m[P + "spec_decode_accepted_tokens"]) == 15
    assert sample(m[P + "spec_decode_fallbacks"]) == 1
    assert sample(m[P + "spec_decode_acceptance_rate"]) == 0.75


def test_an_engine_that_does_not_draft_exports_no_spec_series():
    metrics = ServerMetrics("m")
    metrics.publish_kv(KVStats(1, 24))
    exported = families(generate_latest(metrics.registry).decode())
    assert P + "spec_decode_draft_tokens" not in exported


def test_a_drafting_server_answers_as_the_plain_one_and_counts_its_drafts(tiny_llama):
    """Completions through a server with prompt lookup equal a plain server's (greedy), and
    /metrics carries the counts."""
    body = {"prompt": "one two three one two three one two", "max_tokens": 24, "ignore_eos": True,
            "temperature": 0}
    texts = []
    # drafting every step (a tiny model's measured costs could pause it)
    for extra in ({}, {"speculative_method": "ngram", "prompt_lookup_min": 1,
                       "speculative_cost_aware": False}):
        kwargs = dict(model_path=str(tiny_llama), **TINY_KV, **extra)
        with live_server(kwargs, served_model_name="tiny") as server:
            with httpx.Client(base_url=server.url, timeout=60) as http:
                r = http.post("/v1/completions", json=body)
                assert r.status_code == 200
                texts.append(r.json()["choices"][0]["text"])
                m = families(http.get("/metrics").text)
    assert texts[0] == texts[1]
    assert sample(m[P + "spec_decode_num_drafts"]) > 0
