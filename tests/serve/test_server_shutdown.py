"""Graceful shutdown (serve/shutdown.py): new requests get 503 at once, running ones finish within
shutdown_timeout_s, the rest end with an error (streams: an error chunk, then [DONE]), then the server stops.

In process, `begin_shutdown()` does what SIGTERM does; the last test sends the real signal to a real process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import write_tiny_model
from tests.serve.conftest import TINY_KV, free_port, live_server

LONG = {"prompt": "Alice was", "max_tokens": 200, "ignore_eos": True, "temperature": 0}


def sse_events(response) -> list:
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in response.iter_lines() if line]


@pytest.fixture()
def kwargs(tiny_llama) -> dict:
    return dict(model_path=str(tiny_llama), **TINY_KV)


def gate_forward(server, gate: threading.Event, step_s: float | None = None) -> None:
    """Hold every forward until `gate` is set (or, with step_s, slow each forward down by up to step_s)."""
    model = server.worker.engine.model

    def gated_forward(*args, **kw):
        gate.wait(step_s if step_s is not None else 30)
        return type(model).forward(model, *args, **kw)

    model.forward = gated_forward


def test_during_shutdown_new_requests_get_503_and_a_running_stream_finishes(kwargs):
    with live_server(kwargs, shutdown_timeout_s=30) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        gate = threading.Event()
        gate_forward(server, gate)
        with http.stream("POST", "/v1/completions", json={**LONG, "max_tokens": 8, "stream": True}) as running:
            assert server.wait_until(lambda: server.state.num_pending == 1)
            server.server.begin_shutdown()
            assert server.wait_until(lambda: server.state.shutting_down)
            health = http.get("/health")
            assert health.status_code == 503 and "shutting down" in health.json()["error"]["message"]
            r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 503 and r.headers["retry-after"]
            assert r.json()["error"]["code"] == "shutting_down"
            gate.set()
            events = sse_events(running)
        assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        server.thread.join(30)
        assert not server.thread.is_alive() and server.worker.state == "stopped"


def test_shutdown_ends_requests_past_the_timeout_with_an_error_then_done(kwargs):
    with live_server(kwargs, shutdown_timeout_s=0.3) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        gate_forward(server, threading.Event(), step_s=0.02)  # 200 tokens take seconds
        plain: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: plain.append(http.post("/v1/completions", json=LONG)))
        with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as stream:
            waiter.start()
            assert server.wait_until(lambda: server.state.num_pending == 2)
            server.server.begin_shutdown()
            events = sse_events(stream)
        waiter.join(30)
        assert events[-1] == "[DONE]"
        error = events[-2]["error"]
        assert error["type"] == "service_unavailable_error" and error["code"] == "shutting_down"
        assert "--shutdown-timeout-s" in error["message"]
        assert len(events) > 2 and "choices" in events[0]  # it was running, and was cut at a chunk boundary
        assert plain[0].status_code == 503 and plain[0].json()["error"]["code"] == "shutting_down"
        server.thread.join(30)
        assert not server.thread.is_alive()
        assert server.state.num_pending == 0 and server.worker.core.num_live == 0  # aborted, their blocks freed


def test_a_second_request_to_stop_ends_the_running_requests_at_once(kwargs):
    with live_server(kwargs, shutdown_timeout_s=600) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        gate_forward(server, threading.Event(), step_s=0.02)
        with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as stream:
            assert server.wait_until(lambda: server.state.num_pending == 1)
            server.server.begin_shutdown()
            assert server.wait_until(lambda: server.state.shutting_down)
            server.server.begin_shutdown()  # a second SIGTERM or Ctrl-C
            events = sse_events(stream)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "shutting_down"
        server.thread.join(30)
        assert not server.thread.is_alive()


def test_an_idle_server_stops_at_once(kwargs):
    with live_server(kwargs, shutdown_timeout_s=600) as server:
        server.server.begin_shutdown()
        server.thread.join(10)
        assert not server.thread.is_alive() and server.worker.state == "stopped"


@pytest.fixture(scope="module")
def tiny_llama_4k(tmp_path_factory) -> Path:
    """The tiny model with a 4096-token context: a stream long enough to outlive a short shutdown timeout."""
    folder = tmp_path_factory.mktemp("tiny-llama-4k")
    write_tiny_model(folder, max_position_embeddings=4096)
    return folder


def start_server(model: Path, port: int, *flags: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "flashmemory.serve", str(model), "--port", str(port),
                             "--log-level", "warning", *flags], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while True:
        assert proc.poll() is None, proc.communicate()[1]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.2)


def test_sigterm_finishes_short_streams_ends_long_ones_with_an_error_then_done_and_exits_0(tiny_llama_4k):
    port = free_port()
    proc = start_server(tiny_llama_4k, port, "--shutdown-timeout-s", "1")  # the long stream needs ~10 s
    long_body = {**LONG, "max_tokens": 4000, "stream": True}
    short_body = {**LONG, "max_tokens": 12, "stream": True, "stream_options": {"include_usage": True}}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http, \
                http.stream("POST", "/v1/completions", json=long_body) as long_stream, \
                http.stream("POST", "/v1/completions", json=short_body) as short_stream:
            long_lines, short_lines = long_stream.iter_lines(), short_stream.iter_lines()
            first_long, first_short = next(long_lines), next(short_lines)  # both are running
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi"}, timeout=10)
            assert r.status_code == 503 and r.headers["retry-after"]
            short = sse_events_of([first_short, *short_lines])
            long = sse_events_of([first_long, *long_lines])
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert short[-1] == "[DONE]" and short[-2]["usage"]["completion_tokens"] == 12
    assert short[-3]["choices"][0]["finish_reason"] == "length"
    assert long[-1] == "[DONE]" and long[-2]["error"]["code"] == "shutting_down"
    assert proc.returncode == 0, err
    assert "Traceback" not in err


def sse_events_of(lines) -> list:
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines if line]
