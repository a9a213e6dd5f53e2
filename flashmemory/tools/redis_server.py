"""A local redis-server on a free loopback port, for the shared KV level's tests and benchmark:
started in a folder of its own with no persistence, stopped (killed) and started again on the
same port by the fault tests."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

INSTALL = "apt-get install redis-server (or bash scripts/install_redis.sh, as root)"
START_TIMEOUT_S = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_binary() -> str | None:
    return shutil.which("redis-server")


class LocalRedis:
    """One redis-server process on 127.0.0.1:`port`; `extra`: more redis-server arguments."""

    def __init__(self, folder: Path, port: int | None = None, *extra: str) -> None:
        binary = redis_binary()
        if binary is None:
            raise FileNotFoundError(f"redis-server is not installed: {INSTALL}")
        self.binary, self.folder, self.extra = binary, Path(folder), extra
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> LocalRedis:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.folder), *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def client(self):
        import redis

        return redis.Redis.from_url(self.url)

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()
