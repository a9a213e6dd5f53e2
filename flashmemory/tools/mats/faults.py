"""Disk faults for MATS-2: a PositionalIO that corrupts, refuses or delays the cold-zone file's I/O on demand, and
a ledger pairing every injected fault with what became of it (detected, or served).

Per-read and per-write faults (a flipped bit in what a read returns, ENOSPC or EIO on a block write) are remembered per
thread until the code that did the I/O either raises (detected) or returns (served, an error). File-level faults
(the file truncated or deleted under the cache) are events: the suite reads a lost block right after each one,
and the read must fail.
"""

from __future__ import annotations

import errno
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from flashmemory.kvcache.levels.file_io import PositionalIO

SMALL_WRITE_BYTES = 4  # DiskPool.free zeroes a record's magic: not a block write, never refused
SLOW_READ_S = (0.0005, 0.004)  # a slow read sleeps this long (uniform), widening races with the prefetch threads


@dataclass
class Fault:
    """One injected fault and its outcome."""

    kind: str  # "bit flip" | "ENOSPC" | "EIO" | "truncation" | "deletion"
    where: str
    detected: bool = False  # the code raised a ColdBlockError / ColdZoneFullError for it
    served: bool = False  # the code returned as if nothing was wrong


class FaultLedger:
    """Owns every fault injected in one run and the per-thread fault awaiting its outcome."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.faults: list[Fault] = []
        # (thread id, "read" | "write") -> the fault the thread's current read or write carries
        self._pending: dict[tuple[int, str], Fault] = {}

    def inject(self, kind: str, where: str, channel: str | None = None) -> Fault:
        """Record a fault; with a channel ("read" / "write") it awaits the outcome of this thread's current call."""
        fault = Fault(kind, where)
        with self._lock:
            self.faults.append(fault)
            if channel is not None:
                self._pending[(threading.get_ident(), channel)] = fault
        return fault

    def resolve(self, channel: str, detected: bool) -> Fault | None:
        """This thread's read or write ended: raised a typed error (detected) or returned (served)."""
        with self._lock:
            fault = self._pending.pop((threading.get_ident(), channel), None)
        if fault is not None:
            fault.detected, fault.served = detected, not detected
        return fault

    def injected(self) -> Counter[str]:
        return Counter(f.kind for f in self.faults)

    def detected(self) -> Counter[str]:
        return Counter(f.kind for f in self.faults if f.detected)

    def undetected(self) -> list[Fault]:
        return [f for f in self.faults if not f.detected]


class FaultyDiskIO(PositionalIO):
    """The cold-zone file's positional I/O with faults on demand (armed by the suite, from any thread)."""

    def __init__(self, ledger: FaultLedger, seed: int) -> None:
        super().__init__()
        self.ledger = ledger
        self._rng = random.Random(seed)
        self._armed_lock = threading.Lock()
        self.flips_armed = 0  # the next reads (any thread's) that each get one bit flipped
        self.background_flips_armed = 0  # the next reads by a thread other than the main one (prefetch readers)
        self.write_errors_armed: list[int] = []  # errnos the next block writes fail with, in order (ENOSPC, EIO)
        self.slow_read_probability = 0.0
        self.slow_reads = 0
        self._quiet = 0  # > 0: inject nothing (the suite's own reference reads)

    @contextmanager
    def quiet(self) -> Iterator[None]:
        with self._armed_lock:
            self._quiet += 1
        try:
            yield
        finally:
            with self._armed_lock:
                self._quiet -= 1

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        data = super().pread(fd, size, offset)
        with self._armed_lock:
            slow = not self._quiet and self._rng.random() < self.slow_read_probability
            background = threading.current_thread() is not threading.main_thread()
            flip = not self._quiet and len(data) > 0 and (
                self.flips_armed > 0 or (background and self.background_flips_armed > 0))
            if flip:
                if background and self.background_flips_armed > 0:
                    self.background_flips_armed -= 1
                else:
                    self.flips_armed -= 1
                bit = self._rng.randrange(len(data) * 8)
            delay = self._rng.uniform(*SLOW_READ_S) if slow else 0.0
        if slow:
            self.slow_reads += 1
            time.sleep(delay)
        if not flip:
            return data
        corrupted = bytearray(data)
        corrupted[bit // 8] ^= 1 << (bit % 8)
        self.ledger.inject("bit flip", f"bit {bit} of {len(data)} bytes read at offset {offset}", "read")
        return bytes(corrupted)

    def pwrite(self, fd: int, data: bytes, offset: int) -> None:
        with self._armed_lock:
            refuse = not self._quiet and bool(self.write_errors_armed) and len(data) > SMALL_WRITE_BYTES
            code = self.write_errors_armed.pop(0) if refuse else 0
        if refuse:
            name = errno.errorcode.get(code, str(code))
            self.ledger.inject(name, f"a {len(data)}-byte block write at offset {offset}", "write")
            raise OSError(code, os.strerror(code))
        super().pwrite(fd, data, offset)
