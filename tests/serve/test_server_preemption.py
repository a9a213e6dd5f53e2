"""Preemption end to end: under L0 pressure sequences are demoted and resumed, under L1 pressure recomputed —
every request still finishes with the text it would have produced alone."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import openai

from flashmemory import FlashMemoryEngine
from flashmemory.kvcache.manager.blocks import Level
from flashmemory.kvcache.tiered import TieredKVCache
from tests.serve.conftest import TINY_KV, live_server

PROMPTS = ["Alice was beginning", "The capital of France", "Caf\u00e9 cr\u00e8me and", "emoji and numbers 0123"]
MAX_TOKENS = 60


def _preemptions(server, kind: str) -> float:
    return server.state.metrics._preemptions.labels(server.state.model_name, kind)._value.get()


def _run_concurrently(server) -> list[str]:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def complete(prompt: str) -> str:
        r = client.completions.create(model=server.state.model_name, prompt=prompt, max_tokens=MAX_TOKENS,
                                      temperature=0, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == MAX_TOKENS and r.choices[0].finish_reason == "length"
        return r.choices[0].text

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(complete, PROMPTS))


def test_device_pressure_demotes_and_resumes_without_changing_any_answer(tiny_llama):
    kwargs = dict(model_path=str(tiny_llama), **TINY_KV)
    reference = FlashMemoryEngine(**kwargs)
    alone = [reference.generate(p, max_new_tokens=MAX_TOKENS, ignore_eos=True) for p in PROMPTS]

    def small_device_factory():
        # L0 for 12 blocks: each sequence wants its 4-block window plus the sink block, so 4 cannot all stay.
        engine = FlashMemoryEngine(**kwargs)
        engine.cache.close()
        engine.cache = TieredKVCache(dataclasses.replace(engine.cache.cfg, device_slots=12))
        return engine

    with live_server(kwargs, engine_factory=small_device_factory) as server:
        assert server.worker.scheduler.budget.capacity_blocks[Level.DEVICE] == 12
        assert _run_concurrently(server) == alone
        assert _preemptions(server, "demote") > 0
        assert server.wait_until(server.kv_idle)


def test_host_pressure_without_a_cold_zone_recomputes_without_dropping_anything(tiny_llama):
    kwargs = dict(model_path=str(tiny_llama), **{**TINY_KV, "kv_precision": "fp16", "selection": "exact",
                                                  "cold_zone_enabled": False, "cpu_memory_gb": 3e-5})
    reference = FlashMemoryEngine(**kwargs)
    alone = [reference.generate(p, max_new_tokens=MAX_TOKENS, ignore_eos=True) for p in PROMPTS]
    with live_server(kwargs) as server:
        host_blocks = server.worker.scheduler.budget.capacity_blocks[Level.HOST]
        assert 8 <= host_blocks < 16  # one request (up to 8 blocks) fits, two at full length do not
        assert _run_concurrently(server) == alone
        assert _preemptions(server, "recompute") > 0
        assert server.wait_until(server.kv_idle)
