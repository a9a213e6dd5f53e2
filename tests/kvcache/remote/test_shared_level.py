"""The shared level through the engine, with a real redis-server: a document one engine prefilled
is answered by another with its blocks read from Redis, the same greedy text as computing it;
a damaged or foreign value is recomputed, never served; a Redis that is down at start, or dies
and comes back, leaves every answer right."""

from __future__ import annotations

import logging
import shutil
import time

import pytest

from flashmemory import FlashMemoryEngine
from flashmemory.errors import ConfigError, RemoteUnavailableError
from flashmemory.kvcache.remote import redis_store
from tests.helpers import write_tiny_model
from tests.redis_helpers import free_port

EXACT = dict(kv_precision="fp16", selection="exact", block_size=8, active_window=32,
             warm_tokens=32, prefill_chunk_tokens=32, cpu_memory_gb=0.01, cold_zone_gb=0.01)
MIXED = dict(block_size=8, active_window=32, warm_tokens=32, prefill_chunk_tokens=32,
             recent_fp16_tokens=8, cpu_memory_gb=0.01, cold_zone_gb=0.01)
DOCUMENT = ("Alice was beginning to get very tired of sitting by her sister on the bank, and of "
            "having nothing to do. ") * 3


def _engine(model, folder, url=None, **knobs) -> FlashMemoryEngine:
    remote = {} if url is None else dict(remote_kv_url=url, remote_kv_namespace="t")
    return FlashMemoryEngine(model_path=str(model), cold_zone_dir=str(folder),
                             **{**EXACT, **remote, **knobs})


def _answer(engine, question: str) -> str:
    return engine.generate(DOCUMENT + question, max_new_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("knobs", [EXACT, MIXED], ids=["exact", "mixed"])
def test_a_document_prefilled_by_one_engine_is_read_by_another(tiny_llama, tmp_path, redis_server,
                                                                 knobs):
    a = _engine(tiny_llama, tmp_path / "a", redis_server.url, **knobs)
    _answer(a, "Who is she?")
    a.cache.shared.flush()
    published = a.stats()["remote_kv_published_blocks"]
    assert published >= len(a.tokenizer.encode(DOCUMENT)) // 8 - 1
    # replica B loads the same model from another path: its blocks have the same names
    copy = tmp_path / "model-copy"
    shutil.copytree(tiny_llama, copy)
    b = _engine(copy, tmp_path / "b", redis_server.url, **knobs)
    got = _answer(b, "What was Alice doing?")
    stats = b.stats()
    assert stats["remote_kv_hit_blocks"] >= published - 2  # all but the question's blocks
    assert stats["prefix_cache_hits"] >= 8 * stats["remote_kv_hit_blocks"]
    # The same greedy text as an engine that computed the document itself: from scratch for the
    # exact cache; for the mixed one, as this engine's own cached prefix would have given it.
    alone = _engine(tiny_llama, tmp_path / "c", **knobs)
    if knobs is MIXED:
        _answer(alone, "Who is she?")
    assert got == _answer(alone, "What was Alice doing?")
    b.cache.shared.flush()
    assert b.stats()["remote_kv_published_blocks"] <= 2  # what it read is not written back
    for engine in (a, b, alone):
        engine.close()


def _publish_document(model, folder, url) -> FlashMemoryEngine:
    a = _engine(model, folder, url)
    _answer(a, "Who is she?")
    a.cache.shared.flush()
    return a


def _keys(redis_server) -> list[bytes]:
    return sorted(redis_server.client().keys("fm:v1:t:*"))


@pytest.mark.parametrize("damage", ["truncated", "checksum", "garbage"])
def test_a_damaged_value_is_a_miss_and_the_prompt_is_computed(tiny_llama, tmp_path, redis_server,
                                                              damage):
    a = _publish_document(tiny_llama, tmp_path / "a", redis_server.url)
    client = redis_server.client()
    names = _keys(redis_server)
    # damage every block: whichever the lookup reaches first is refused
    for key in names:
        value = client.get(key)
        if damage == "truncated":
            value = value[: len(value) // 2]
        elif damage == "checksum":
            value = value[:100] + bytes([value[100] ^ 1]) + value[101:]
        else:
            value = b"not a block"
        client.set(key, value)
    b = _engine(tiny_llama, tmp_path / "b", redis_server.url)
    got = _answer(b, "What was Alice doing?")
    stats = b.stats()
    assert stats["remote_kv_hit_blocks"] == 0
    reason = {"truncated": "truncated", "checksum": "checksum", "garbage": "format"}[damage]
    assert stats[f"remote_kv_load_failures_{reason}"] == 1
    assert got == _answer(_engine(tiny_llama, tmp_path / "c"), "What was Alice doing?")
    a.close(), b.close()


def test_a_value_of_another_model_is_a_miss(tiny_llama, tmp_path, redis_server):
    other = tmp_path / "other-model"
    write_tiny_model(other, "LlamaForCausalLM", seed=5)
    a = _publish_document(tiny_llama, tmp_path / "a", redis_server.url)
    b = _engine(other, tmp_path / "b", redis_server.url)
    client = redis_server.client()
    # What b will look for (its own names: its namespace is another model's) holds a's values.
    ids = b.tokenizer.encode(DOCUMENT + "What was Alice doing?")
    from flashmemory.kvcache.manager.prefix_cache import chain_hashes

    names = chain_hashes(ids, 8, b.cache.prefix_cache.namespace)
    theirs = _keys(redis_server)
    for name, key in zip(names, theirs):
        client.set(b.cache.shared.store.key(name), client.get(key))
    got = _answer(b, "What was Alice doing?")
    stats = b.stats()
    assert stats["remote_kv_hit_blocks"] == 0 and stats["remote_kv_load_failures_namespace"] == 1
    assert got == _answer(_engine(other, tmp_path / "c"), "What was Alice doing?")
    a.close(), b.close()


def test_redis_down_at_start_refuses_or_warns_as_set(tiny_llama, tmp_path, caplog):
    pytest.importorskip("redis")
    url = f"redis://:hunter2@127.0.0.1:{free_port()}/0"
    with pytest.raises(RemoteUnavailableError, match=r"127\.0\.0\.1.*remote_kv_required") as info:
        _engine(tiny_llama, tmp_path / "a", url, remote_kv_required=True, remote_kv_timeout_ms=200)
    assert "hunter2" not in str(info.value)
    with caplog.at_level(logging.WARNING):
        engine = _engine(tiny_llama, tmp_path / "b", url, remote_kv_timeout_ms=200)
    assert any("local levels only" in r.getMessage() for r in caplog.records)
    assert not any("hunter2" in r.getMessage() for r in caplog.records)
    assert _answer(engine, "Who?") == _answer(_engine(tiny_llama, tmp_path / "c"), "Who?")
    assert engine.stats()["remote_kv_available"] == 0
    engine.close()


def test_redis_killed_mid_run_then_restarted(tiny_llama, tmp_path, redis_server, monkeypatch):
    monkeypatch.setattr(redis_store, "FIRST_PAUSE_S", 0.2)
    a = _engine(tiny_llama, tmp_path / "a", redis_server.url, remote_kv_timeout_ms=300)
    _answer(a, "Who is she?")
    a.cache.shared.flush()
    redis_server.kill()
    alone = _engine(tiny_llama, tmp_path / "c")
    # another document: looked up (the failure), then computed here
    assert a.generate("The capital of France is Paris. " * 6, max_new_tokens=8) == \
        alone.generate("The capital of France is Paris. " * 6, max_new_tokens=8)
    assert a.stats()["remote_kv_network_failures"] >= 1
    redis_server.start()
    time.sleep(0.3)
    third = "Cafe creme, naive resume. " * 6
    assert a.generate(third, max_new_tokens=8) == alone.generate(third, max_new_tokens=8)
    a.cache.shared.flush()
    assert a.stats()["remote_kv_available"] == 1
    assert len(_keys(redis_server)) > 0  # publishing again
    a.close(), alone.close()


def test_bad_remote_settings_name_the_fix(tiny_llama, tmp_path):
    with pytest.raises(ConfigError, match="not a Redis URL"):
        _engine(tiny_llama, tmp_path, "http://127.0.0.1:6379")
    with pytest.raises(ConfigError, match="kv_cache='tiered'"):
        _engine(tiny_llama, tmp_path, "redis://127.0.0.1:1/0", kv_cache="contiguous")
    with pytest.raises(ConfigError, match="remote_kv_namespace"):
        FlashMemoryEngine(model_path=str(tiny_llama), remote_kv_url="redis://127.0.0.1:1/0",
                          remote_kv_namespace="a:b")
