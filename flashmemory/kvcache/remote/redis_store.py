"""RedisBlockStore: the shared level's I/O, one Redis key per full block.

Keys are `fm:v1:<namespace>:<chain hash, hex>` (remote_kv_namespace: replicas that should share
name the same one); values are block_record.py's. Writes are `SET NX` with a TTL: the first
replica to publish a block wins, the others' copies are the same bytes. Reads are one pipelined
`GET` per batch of names, in order, so a lookup costs one round trip per batch.

The network never fails a request: every call has a timeout (remote_kv_timeout_ms), and a
connection error or timeout marks Redis down for a growing pause (1 s doubling to 30 s), during
which lookups are misses and publishing is skipped, both counted; the next call after the pause
tries again, so a Redis that comes back is used again. A full Redis (`maxmemory` with eviction,
or writes refused under `noeviction`) is a miss, not an error. With remote_kv_max_mb, blocks are
published only while Redis' `used_memory` (read at most every 2 s) is under it."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass

from flashmemory.errors import RemoteUnavailableError
from flashmemory.kv_settings import redacted_url

logger = logging.getLogger(__name__)

KEY_VERSION = "v1"
FIRST_PAUSE_S = 1.0
MAX_PAUSE_S = 30.0
USED_MEMORY_EVERY_S = 2.0


@dataclass(frozen=True)
class RedisSettings:
    """The shared level's settings, as KVSettings' remote_kv_* fields hold them."""

    url: str
    namespace: str
    ttl_s: int
    max_bytes: int | None
    timeout_s: float


def _redis():
    try:
        import redis
    except ImportError as e:  # pragma: no cover - the cluster extra is not installed
        raise RemoteUnavailableError(
            "remote_kv_url needs the redis client: pip install 'flashmemory-runtime[cluster]'"
        ) from e
    return redis


class RedisBlockStore:
    """Reads and writes block records; counts what happened; never raises on the network."""

    def __init__(self, settings: RedisSettings) -> None:
        self.settings = settings
        redis = _redis()
        self._errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
                        OSError)
        self._response_error = redis.exceptions.ResponseError
        self._client = redis.Redis.from_url(
            settings.url, socket_timeout=settings.timeout_s,
            socket_connect_timeout=settings.timeout_s, retry_on_timeout=False)
        self._lock = threading.Lock()  # the publisher thread and the engine thread share it
        self._down_until = 0.0
        self._pause_s = FIRST_PAUSE_S
        self._used_memory: tuple[float, int] | None = None  # (read at, bytes)
        self.answering = True  # the last call got an answer
        self.counters: Counter[str] = Counter()

    def key(self, name: int) -> str:
        return f"fm:{KEY_VERSION}:{self.settings.namespace}:{name:032x}"

    @property
    def available(self) -> bool:
        """Not in a pause after a network failure."""
        return time.monotonic() >= self._down_until

    def ping(self) -> bool:
        """Whether Redis answers now (a failure starts a pause, as any call's)."""
        try:
            with self._lock:
                self._client.ping()
        except self._errors as e:
            self._failed("ping", e)
            return False
        self._recovered()
        return True

    def get_many(self, names: list[int]) -> list[bytes | None]:
        """The values under `names`, None where there is none; all None while Redis is down."""
        if not names:
            return []
        if not self.available:
            self.counters["lookups_skipped_down"] += 1
            return [None] * len(names)
        try:
            with self._lock:
                pipe = self._client.pipeline(transaction=False)
                for name in names:
                    pipe.get(self.key(name))
                values = pipe.execute()
        except self._errors as e:
            self._failed("get", e)
            return [None] * len(names)
        self._recovered()
        return [v if isinstance(v, bytes) else None for v in values]

    def put(self, name: int, value: bytes) -> str:
        """Publish a block: "stored", "exists" (another replica was first), "cap" (Redis is at
        remote_kv_max_mb), "full" (Redis refused the write), "down"."""
        if not self.available:
            return "down"
        try:
            with self._lock:
                if self._at_cap():
                    return "cap"
                stored = self._client.set(self.key(name), value, nx=True, ex=self.settings.ttl_s)
        except self._response_error as e:  # OOM under maxmemory noeviction
            logger.debug("redis refused a block: %s", e)
            return "full"
        except self._errors as e:
            self._failed("set", e)
            return "down"
        self._recovered()
        return "stored" if stored else "exists"

    def _at_cap(self) -> bool:
        cap = self.settings.max_bytes
        if cap is None:
            return False
        now = time.monotonic()
        if self._used_memory is None or now - self._used_memory[0] > USED_MEMORY_EVERY_S:
            used = int(self._client.info("memory").get("used_memory", 0))
            self._used_memory = (now, used)
        return self._used_memory[1] >= cap

    def _failed(self, what: str, error: Exception) -> None:
        self.counters[f"{what}_failures"] += 1
        self.answering = False
        if self.available:  # the first failure of a pause is logged, not every call in it
            logger.warning("the shared KV level at %s did not answer (%s: %s): local levels only "
                           "for %.0f s, then it is tried again", redacted_url(self.settings.url),
                           type(error).__name__, error, self._pause_s)
        self._down_until = time.monotonic() + self._pause_s
        self._pause_s = min(MAX_PAUSE_S, 2 * self._pause_s)

    def _recovered(self) -> None:
        self.answering = True
        if self._pause_s != FIRST_PAUSE_S:
            logger.info("the shared KV level at %s answers again", redacted_url(self.settings.url))
        self._pause_s = FIRST_PAUSE_S

    def close(self) -> None:
        try:
            self._client.close()
        except self._errors:  # pragma: no cover - closing a dead connection
            pass
