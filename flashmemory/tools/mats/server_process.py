"""ServerProcess: a real `python -m flashmemory.serve` child on a free loopback port, watched from outside — its
resident memory (RSS) from the OS and its cold-zone folder's allocated bytes from the file system."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

import flashmemory

STOP_TIMEOUT_S = 20.0  # SIGINT, then this long for a clean exit before SIGKILL


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int | None:
    """Resident set size of a process (Linux /proc; psutil elsewhere when installed); None when unknown."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil
    except ImportError:
        return None
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except psutil.Error:
        return None


def allocated_bytes(folder: Path) -> int:
    """Disk space the files in `folder` really take (sparse files count only their written blocks)."""
    total = 0
    for path in folder.glob("**/*"):
        try:
            st = path.stat()
        except OSError:
            continue
        if path.is_file():
            total += st.st_blocks * 512 if hasattr(st, "st_blocks") else st.st_size
    return total


class ServerProcess:
    """Owns one server child process, its log file and the cold-zone folder it was given."""

    def __init__(self, model: str | None, extra_args: list[str], cold_zone_dir: Path, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cold_zone_dir = cold_zone_dir
        self.log_path = log_path
        self.args = [sys.executable, "-m", "flashmemory.serve", "--host", "127.0.0.1", "--port", str(self.port),
                     "--cold-zone-dir", str(cold_zone_dir), "--log-level", "warning", "--stats-log-interval-s", "0",
                     *(["--model", model] if model else []), *extra_args]
        self.process: subprocess.Popen | None = None
        self._log = None

    @property
    def pid(self) -> int:
        assert self.process is not None, "the server was not started"
        return self.process.pid

    def start(self, timeout_s: float) -> float:
        """Start the server and wait until /health says it is ready; returns the seconds that took."""
        self.cold_zone_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        # The child runs this same copy of flashmemory, wherever it was imported from.
        package_root = str(Path(flashmemory.__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        self._log = open(self.log_path, "wb")
        started = time.monotonic()
        self.process = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = started + timeout_s
        with httpx.Client(base_url=self.url, timeout=5) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"the server exited with status {self.process.returncode} while starting; "
                                       f"its log: {self.log_path}\n{self.log_tail()}")
                try:
                    if client.get("/health").status_code == 200:
                        return time.monotonic() - started
                except httpx.TransportError:
                    pass
                time.sleep(0.25)
        raise RuntimeError(f"the server was not ready after {timeout_s:.0f} s; its log: {self.log_path}\n"
                           f"{self.log_tail()}")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def rss_bytes(self) -> int | None:
        return rss_bytes(self.pid) if self.alive() else None

    def disk_bytes(self) -> int:
        return allocated_bytes(self.cold_zone_dir)

    def stop(self) -> int | None:
        """Ask the server to stop (SIGINT, as Ctrl-C), kill it if it does not; returns its exit status."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.process.returncode

    def log_tail(self, num_lines: int = 20) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-num_lines:])
