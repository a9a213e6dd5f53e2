"""A real uvicorn server on a free loopback port, in a background thread of the test process."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import uvicorn

from flashmemory.serve.app import create_app
from flashmemory.serve.config import ServerConfig
from flashmemory.serve.shutdown import GracefulServer
from tests.helpers import wait_for

LOAD_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """Owns one uvicorn server thread and the app it serves."""

    def __init__(self, app) -> None:
        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # A generous keep-alive: a client reusing a connection just as the server drops it idle is a race of
        # HTTP itself, not of the server under test.
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", timeout_keep_alive=60)
        self.server = GracefulServer(config, app.state.server)  # begin_shutdown() does what SIGTERM does
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def state(self):
        return self.app.state.server

    @property
    def worker(self):
        return self.state.worker

    def start(self, wait_ready: bool = True) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        if wait_ready:
            assert self.worker.ready.wait(LOAD_TIMEOUT_S), "the model did not load"
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def wait_until(self, condition: Callable[[], bool], timeout_s: float = 20.0) -> bool:
        return wait_for(condition, timeout_s, interval_s=0.02)

    def kv_idle(self) -> bool:
        """No sequence alive and no block held on any level (the engine thread's latest snapshot)."""
        s = self.worker.kv_stats
        return (s.get("num_sequences") == 0 and all(s.get(f"L{i}_blocks", 0) == 0 for i in range(3))
                and not self.worker.scheduler.has_work())


@contextmanager
def live_server(engine_kwargs: dict[str, Any], engine_factory=None, wait_ready: bool = True,
                **server_settings: Any) -> Iterator[LiveServer]:
    config = ServerConfig(**{"stats_log_interval_s": 0, **server_settings})
    fatal: list[str] = []
    server = LiveServer(create_app(config, engine_kwargs, engine_factory=engine_factory, on_fatal=fatal.append))
    server.fatal = fatal  # what the engine reported when it died at run time (the launcher then exits 1)
    server.start(wait_ready)
    try:
        yield server
    finally:
        server.stop()


TINY_KV = dict(block_size=8, active_window=32, warm_tokens=32, prefill_chunk_tokens=64, cpu_memory_gb=0.01,
               cold_zone_gb=0.01, max_num_seqs=16)


@pytest.fixture(scope="module")
def tiny_server(tiny_llama) -> Iterator[LiveServer]:
    """The tiny random model with all three KV levels in use (tiny window and warm span)."""
    with live_server(dict(model_path=str(tiny_llama), **TINY_KV), served_model_name="tiny") as server:
        yield server


@pytest.fixture()
def http(tiny_server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=tiny_server.url, timeout=60) as client:
        yield client
