"""Loading, dying, failing mid-stream, a full queue and disabled streaming: the server says so and stays sane."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from flashmemory import FlashMemoryEngine
from flashmemory.errors import CapacityError, ConfigError, DeviceLostError
from tests.serve.conftest import TINY_KV, live_server

LONG = {"prompt": "Alice was", "max_tokens": 200, "ignore_eos": True, "temperature": 0}


def sse_events(response) -> list:
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in response.iter_lines() if line]


@pytest.fixture()
def kwargs(tiny_llama) -> dict:
    return dict(model_path=str(tiny_llama), **TINY_KV)


def test_health_is_503_while_the_model_loads_then_200(kwargs):
    release = threading.Event()

    def slow_factory():
        release.wait(60)
        return FlashMemoryEngine(**kwargs)

    with live_server(kwargs, engine_factory=slow_factory, wait_ready=False) as server, \
            httpx.Client(base_url=server.url, timeout=30) as http:
        r = http.get("/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
        r = http.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503 and r.headers["retry-after"]
        assert http.get("/metrics").status_code == 200  # scrapes work during loading
        release.set()
        assert server.worker.ready.wait(60)
        assert http.get("/health").status_code == 200
        assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_a_model_that_fails_to_load_leaves_health_at_503_with_the_reason(kwargs):
    def failing_factory():
        raise CapacityError("simulated: no memory for the KV pools")

    with live_server(kwargs, engine_factory=failing_factory) as server, \
            httpx.Client(base_url=server.url, timeout=30) as http:
        r = http.get("/health")
        assert r.status_code == 503 and "simulated: no memory" in r.json()["error"]["message"]
        assert http.post("/v1/completions", json={"prompt": "hi"}).status_code == 503


def test_a_load_failure_shown_on_health_names_no_file_path(kwargs):
    def failing_factory():
        raise ConfigError("cold_zone_dir /srv/cache/kv is writable by others: chmod go-w /srv/cache/kv")

    with live_server(kwargs, engine_factory=failing_factory) as server, \
            httpx.Client(base_url=server.url, timeout=30) as http:
        message = http.get("/health").json()["error"]["message"]
        assert "writable by others" in message and "/srv" not in message and "<path>" in message


def test_an_error_mid_stream_sends_an_error_chunk_then_done_and_frees_the_blocks(kwargs):
    with live_server(kwargs) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        cache = server.worker.engine.cache
        commit, calls = cache.commit, []

        def failing_commit(batch, kept=None):
            calls.append(1)
            if len(calls) == 6:
                raise CapacityError("simulated: a level is full")
            return commit(batch, kept)

        cache.commit = failing_commit
        with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            assert r.status_code == 200
            events = sse_events(r)
        assert events[-1] == "[DONE]"
        assert "choices" in events[0]
        error = events[-2]["error"]
        assert error["type"] == "server_error" and "simulated: a level is full" in error["message"]
        assert server.wait_until(server.kv_idle)
        cache.commit = commit
        # The engine goes on serving.
        assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3}).status_code == 200
        assert http.get("/health").status_code == 200


def test_a_bug_in_one_step_fails_that_stream_and_the_engine_goes_on(kwargs):
    with live_server(kwargs) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        model = server.worker.engine.model
        calls = []

        def broken_once(*args, **kw):
            calls.append(1)
            if len(calls) == 4:
                raise RuntimeError("simulated bug with internal details")
            return type(model).forward(model, *args, **kw)

        model.forward = broken_once
        with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            events = sse_events(r)
        assert events[-1] == "[DONE]"
        message = events[-2]["error"]["message"]
        assert "internal details" not in message and "server log" in message  # no internals leak
        assert http.get("/health").status_code == 200
        assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3}).status_code == 200
        assert server.wait_until(server.kv_idle)


def test_a_dead_engine_ends_streams_with_an_error_and_health_turns_503(kwargs):
    with live_server(kwargs) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        model = server.worker.engine.model
        calls = []

        def broken_forward(*args, **kw):
            calls.append(1)
            if len(calls) > 3:  # the device is lost: only this kind of failure stops the engine
                raise DeviceLostError("simulated device loss with internal details")
            return type(model).forward(model, *args, **kw)

        model.forward = broken_forward
        with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            events = sse_events(r)
        assert events[-1] == "[DONE]"
        message = events[-2]["error"]["message"]
        assert "internal details" not in message and "server log" in message  # no internals leak
        r = http.get("/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert http.post("/v1/completions", json={"prompt": "hi"}).status_code == 503
        assert server.fatal == ["the engine stopped: DeviceLostError"]  # the launcher exits non-zero on this


def test_streaming_disabled_makes_stream_true_a_400(kwargs):
    with live_server(kwargs, enable_streaming=False) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "stream": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200


def test_a_full_queue_is_503_until_a_request_finishes(kwargs):
    with live_server(kwargs, max_pending_requests=1) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        model, gate = server.worker.engine.model, threading.Event()

        def gated_forward(*args, **kw):  # holds the first request inside the engine until the test is done
            gate.wait(30)
            return type(model).forward(model, *args, **kw)

        model.forward = gated_forward
        with http.stream("POST", "/v1/completions", json={**LONG, "max_tokens": 5, "stream": True}) as first:
            assert server.wait_until(lambda: server.state.num_pending == 1)
            r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "server_overloaded"
            assert r.headers["retry-after"]
            gate.set()
            assert sse_events(first)[-1] == "[DONE]"
        assert server.wait_until(lambda: server.state.num_pending == 0)
        assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_the_engine_logs_a_stats_line_while_busy_and_none_while_idle(kwargs, caplog):
    caplog.set_level("INFO", logger="flashmemory.serve.stats_log")
    with live_server(kwargs, stats_log_interval_s=0.05) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        model = server.worker.engine.model
        slow = threading.Event()

        def slow_forward(*args, **kw):  # ~0.5 s of work, so several intervals pass while it runs
            slow.wait(0.02)
            return type(model).forward(model, *args, **kw)

        model.forward = slow_forward
        assert http.post("/v1/completions", json={**LONG, "max_tokens": 25}).status_code == 200
        lines = [r.getMessage() for r in caplog.records if r.name == "flashmemory.serve.stats_log"]
        assert lines and all("generation throughput" in line and "KV usage L0" in line for line in lines)
        assert any("running 1" in line for line in lines)
        server.wait_until(lambda: False, timeout_s=0.3)  # the line for the request's last tokens
        caplog.clear()
        server.wait_until(lambda: False, timeout_s=0.6)  # idle: the engine wakes every 0.05 s and says nothing
        assert [r for r in caplog.records if r.name == "flashmemory.serve.stats_log"] == []
