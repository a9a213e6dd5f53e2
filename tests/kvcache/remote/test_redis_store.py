"""RedisBlockStore against a real redis-server: SET NX with a TTL, pipelined reads, the byte
cap, a full Redis, and a Redis that goes away and comes back (misses in a pause, then used
again), never an exception on the caller's thread."""

from __future__ import annotations

import time

import pytest

from flashmemory.kvcache.remote import redis_store
from flashmemory.kvcache.remote.redis_store import RedisBlockStore, RedisSettings
from tests.redis_helpers import RedisServer, free_port


def _store(url: str, max_bytes: int | None = None, timeout_s: float = 0.5) -> RedisBlockStore:
    return RedisBlockStore(RedisSettings(url, "test", 60, max_bytes, timeout_s))


def test_blocks_are_set_once_with_a_ttl_and_read_in_order(redis_server):
    store = _store(redis_server.url)
    assert store.ping()
    assert store.put(1, b"first") == "stored"
    assert store.put(1, b"second") == "exists"  # another replica was first: its bytes stay
    assert store.put(2, b"two") == "stored"
    assert store.get_many([1, 3, 2]) == [b"first", None, b"two"]
    client = redis_server.client()
    key = store.key(1)
    assert key == "fm:v1:test:" + f"{1:032x}"
    assert 0 < client.ttl(key) <= 60
    store.close()


def test_the_byte_cap_stops_publishing(redis_server):
    store = _store(redis_server.url, max_bytes=1)  # Redis uses more than a byte already
    assert store.put(1, b"x") == "cap"
    assert store.get_many([1]) == [None]


def test_a_full_redis_refuses_writes_as_a_skip(tmp_path):
    server = RedisServer(tmp_path / "r", None, "--maxmemory", "2mb", "--maxmemory-policy",
                         "noeviction").start()
    try:
        store = _store(server.url)
        results = {store.put(i, b"z" * 200_000) for i in range(40)}
        assert "full" in results and "stored" in results
    finally:
        server.kill()


def test_a_redis_that_goes_away_is_left_alone_then_used_again(tmp_path, monkeypatch):
    monkeypatch.setattr(redis_store, "FIRST_PAUSE_S", 0.2)
    server = RedisServer(tmp_path / "r").start()
    store = _store(server.url, timeout_s=0.3)
    assert store.put(1, b"one") == "stored"
    server.kill()
    assert store.get_many([1, 2]) == [None, None]  # the failure: a miss, a pause begins
    assert not store.available and store.counters["get_failures"] == 1
    assert store.put(3, b"three") == "down"  # in the pause: not even tried
    assert store.get_many([1]) == [None] and store.counters["lookups_skipped_down"] == 1
    server.start()  # empty: no persistence
    time.sleep(0.25)
    assert store.available
    assert store.put(3, b"three") == "stored"
    assert store.get_many([3]) == [b"three"]
    server.kill()


def test_a_redis_never_there_is_a_ping_that_fails():
    pytest.importorskip("redis")
    store = _store(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.2)
    assert not store.ping() and not store.available
    assert store.get_many([1]) == [None]
