"""Continuous batching end to end: concurrent streams finish correctly and leave no block; disconnects abort."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

PROMPTS = ["Alice was beginning", "The capital of France", "Caf\u00e9 cr\u00e8me and", "emoji and numbers 0123"]


def _sample_running(server, stop: threading.Event, seen: list[int]) -> None:
    while not stop.is_set():
        seen.append(server.worker.scheduler.num_running)
        time.sleep(0.002)


def _abort_count(server) -> float:
    return server.state.metrics._success.labels(server.state.model_name, "abort")._value.get()


def test_sixteen_concurrent_streams_finish_correctly_and_leave_no_block(tiny_server):
    client = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    kwargs = dict(model="tiny", max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    solo = {p: client.completions.create(prompt=p, **kwargs).choices[0].text for p in PROMPTS}

    def stream(i: int) -> tuple[str, str, int]:
        prompt = PROMPTS[i % len(PROMPTS)]
        chunks = list(client.completions.create(prompt=prompt, stream=True, stream_options={"include_usage": True},
                                                **kwargs))
        return prompt, "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage.completion_tokens

    stop, seen = threading.Event(), []
    sampler = threading.Thread(target=_sample_running, args=(tiny_server, stop, seen))
    sampler.start()
    try:
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(stream, range(16)))
    finally:
        stop.set()
        sampler.join()
    assert max(seen) > 1  # sequences really shared forward passes
    for prompt, text, completion_tokens in results:
        assert completion_tokens == 40
        assert text == solo[prompt]  # batching with others changes nothing
    assert tiny_server.wait_until(tiny_server.kv_idle)
    assert tiny_server.state.num_pending == 0


def _slow_model(server, step_s: float):
    """Make each forward take `step_s`, so a request is surely still running when its client leaves."""
    model, never = server.worker.engine.model, threading.Event()

    def slow_forward(*args, **kw):
        never.wait(step_s)
        return type(model).forward(model, *args, **kw)

    model.forward = slow_forward
    return model


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(tiny_server):
    aborted = _abort_count(tiny_server)
    body = {"model": "tiny", "prompt": "Alice was", "max_tokens": 240, "ignore_eos": True, "stream": True}
    model = _slow_model(tiny_server, 0.02)
    try:
        with httpx.Client(base_url=tiny_server.url, timeout=30) as http:
            with http.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                for _ in range(3):
                    assert next(lines).startswith("data: ")
                    next(lines)  # the blank line after each event
                assert tiny_server.worker.kv_stats["num_sequences"] == 1
        # The connection is closed: the engine aborts the sequence and frees its blocks on every level.
        assert tiny_server.wait_until(lambda: _abort_count(tiny_server) == aborted + 1)
        assert tiny_server.wait_until(tiny_server.kv_idle)
        assert tiny_server.state.num_pending == 0
    finally:
        del model.forward


def test_a_client_that_gives_up_on_a_plain_request_frees_its_blocks(tiny_server):
    aborted = _abort_count(tiny_server)
    model = _slow_model(tiny_server, 0.05)
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(tiny_server.url + "/v1/completions", timeout=httpx.Timeout(30, read=0.5),
                       json={"model": "tiny", "prompt": "Alice", "max_tokens": 200, "ignore_eos": True})
        assert tiny_server.wait_until(lambda: _abort_count(tiny_server) == aborted + 1)
        assert tiny_server.wait_until(tiny_server.kv_idle)
    finally:
        del model.forward
