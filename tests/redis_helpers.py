"""The tests' real redis-server (flashmemory/tools/redis_server.py): they skip, naming the
install command, only where the binary or the client is absent."""

from __future__ import annotations

from pathlib import Path

import pytest

from flashmemory.tools.redis_server import INSTALL, LocalRedis, free_port, redis_binary

__all__ = ["RedisServer", "free_port"]


def RedisServer(folder: Path, port: int | None = None, *extra: str) -> LocalRedis:  # noqa: N802
    if redis_binary() is None:
        pytest.skip(f"redis-server is not installed: {INSTALL}")
    pytest.importorskip("redis", reason="pip install 'flashmemory-runtime[cluster]'")
    return LocalRedis(folder, port, *extra)
