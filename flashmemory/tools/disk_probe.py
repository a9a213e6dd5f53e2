"""Measured read speed of the folder the cold zone (L2) lives in: random 4 KiB reads (one at a time, and from
several threads at once) and a sequential read, with real reads that bypass the OS page cache (O_DIRECT where the
file system takes it, else POSIX_FADV_DONTNEED before every read), so the page cache does not lie.

Used by `flashmemory doctor` (the seed's rule: below 50K random-read IOPS, turn the cold zone off) and
`flashmemory diagnose`.
"""

from __future__ import annotations

import mmap
import os
import random
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

MIB = 2**20
BLOCK_BYTES = 4096  # one random read (and the O_DIRECT alignment)
SEQUENTIAL_CHUNK_BYTES = MIB


@dataclass(frozen=True)
class DiskSpeed:
    """What one probe of a folder measured."""

    folder: str
    filesystem: str | None  # from /proc/mounts ("ext4", "tmpfs", ...); None where unknown
    method: str  # "O_DIRECT", "posix_fadvise(DONTNEED)" or "page cache (could not bypass it)"
    file_bytes: int
    random_iops_qd1: float  # 4 KiB random reads per second, one at a time
    random_latency_us_p50: float
    random_latency_us_p99: float
    random_iops_parallel: float  # 4 KiB random reads per second from `threads` threads at once
    threads: int
    sequential_mb_s: float  # MB/s (10^6 bytes) reading the file in 1 MiB chunks

    @property
    def in_memory(self) -> bool:
        """The folder is a RAM file system: its "disk" figures are memory figures."""
        return self.filesystem in ("tmpfs", "ramfs")

    def to_dict(self) -> dict:
        return asdict(self)


def filesystem_of(folder: str | os.PathLike) -> str | None:
    """The type of the file system holding `folder` (longest mount point of /proc/mounts that contains it)."""
    path = str(Path(folder).resolve())
    best, kind = "", None
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) >= 3 and (path == fields[1] or path.startswith(fields[1].rstrip("/") + "/")):
                if len(fields[1]) > len(best):
                    best, kind = fields[1], fields[2]
    except OSError:
        return None
    return kind


class _Reader:
    """Opens the probe file the most honest way this OS and file system allow; reads one aligned block."""

    def __init__(self, path: str, block_bytes: int) -> None:
        self.path = path
        self.block_bytes = block_bytes
        self.method = "page cache (could not bypass it)"
        self.fd = -1
        if hasattr(os, "O_DIRECT") and hasattr(os, "preadv"):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                buf = mmap.mmap(-1, block_bytes)  # page-aligned, as O_DIRECT wants
                os.preadv(fd, [buf], 0)
                self.fd, self.method = fd, "O_DIRECT"
            except OSError:  # EINVAL: the file system refuses O_DIRECT (tmpfs, some overlays)
                try:
                    os.close(fd)
                except (OSError, UnboundLocalError):
                    pass
        if self.fd < 0:
            self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)
                os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
                self.method = "posix_fadvise(DONTNEED)"

    def buffer(self, size: int) -> mmap.mmap:
        return mmap.mmap(-1, size)

    def read(self, buf: mmap.mmap, offset: int) -> None:
        if self.method == "posix_fadvise(DONTNEED)":
            os.posix_fadvise(self.fd, offset, len(buf), os.POSIX_FADV_DONTNEED)
        if hasattr(os, "preadv"):
            os.preadv(self.fd, [buf], offset)
        else:  # no positional reads (Windows): one reader per file descriptor keeps this safe enough for a probe
            os.lseek(self.fd, offset, os.SEEK_SET)
            os.read(self.fd, len(buf))

    def drop_cache(self) -> None:
        if self.method == "posix_fadvise(DONTNEED)":
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        os.close(self.fd)


def _random_reads(reader: _Reader, num_blocks: int, seconds: float, seed: int) -> list[float]:
    """Latencies (seconds) of random block reads issued one after another for `seconds`."""
    rng = random.Random(seed)
    buf = reader.buffer(reader.block_bytes)
    latencies = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        offset = rng.randrange(num_blocks) * reader.block_bytes
        start = time.perf_counter()
        reader.read(buf, offset)
        latencies.append(time.perf_counter() - start)
    return latencies


def _parallel_iops(path: str, block_bytes: int, num_blocks: int, seconds: float, threads: int) -> float:
    readers = [_Reader(path, block_bytes) for _ in range(threads)]  # a descriptor each (no shared seek position)
    counts = [0] * threads

    def run(i: int) -> None:
        counts[i] = len(_random_reads(readers[i], num_blocks, seconds, seed=100 + i))

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    started = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - started
    for r in readers:
        r.close()
    return sum(counts) / elapsed


def _sequential_mb_s(reader: _Reader, file_bytes: int) -> float:
    reader.drop_cache()
    buf = reader.buffer(SEQUENTIAL_CHUNK_BYTES)
    started = time.perf_counter()
    for offset in range(0, file_bytes, SEQUENTIAL_CHUNK_BYTES):
        reader.read(buf, offset)
    return file_bytes / (time.perf_counter() - started) / 1e6


def _write_probe_file(folder: Path, file_bytes: int) -> str:
    fd, name = tempfile.mkstemp(prefix="flashmemory-probe-", suffix=".bin", dir=folder)
    try:
        chunk = os.urandom(MIB)  # incompressible, so no file system can shortcut the reads
        for _ in range(file_bytes // MIB):
            os.write(fd, chunk)
        os.fsync(fd)  # on the disk, so dropping the page cache leaves nothing behind to read from memory
    finally:
        os.close(fd)
    return name


def probe_disk(folder: str | os.PathLike, file_mb: int = 64, seconds: float = 1.0, threads: int = 8) -> DiskSpeed:
    """Measure random and sequential reads of a scratch file of `file_mb` MiB in `folder` (removed afterwards);
    `seconds` per random-read pass. OSError when the folder cannot hold the file."""
    path = Path(folder).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    file_bytes = max(1, file_mb) * MIB
    name = _write_probe_file(path, file_bytes)
    try:
        reader = _Reader(name, BLOCK_BYTES)
        try:
            num_blocks = file_bytes // BLOCK_BYTES
            reader.drop_cache()
            latencies = sorted(_random_reads(reader, num_blocks, seconds, seed=1))
            qd1 = len(latencies) / max(sum(latencies), 1e-9)
            parallel = _parallel_iops(name, BLOCK_BYTES, num_blocks, seconds, threads)
            sequential = _sequential_mb_s(reader, file_bytes)
            method = reader.method
        finally:
            reader.close()
    finally:
        os.unlink(name)
    pick = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1e6  # noqa: E731
    return DiskSpeed(str(path.resolve()), filesystem_of(path), method, file_bytes, qd1, pick(0.50), pick(0.99),
                     parallel, threads, sequential)
