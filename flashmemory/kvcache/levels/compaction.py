"""Compaction of the disk level (seed 004 §3: free pages merged in idle gaps, never during a step).

The cold file is sparse and preallocated by slot; a freed record keeps its disk blocks (its magic
is zeroed so it is never read back as a block), so the file only grows towards the working set's
high-water mark. Compaction gives the file system back the blocks of every record freed since it
was last written, by punching holes over runs of adjacent freed slots. Live records are never read,
moved or written, so a compaction cut short leaves every block as readable as before; a persistent
cache's index never names a freed slot after its next flush, and until then the slot's zeroed
record fails its checks and is discarded, never served. Where the file system cannot punch holes,
nothing changes and the result says so."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from flashmemory.kvcache.levels.file_io import punch_hole


@dataclass
class CompactResult:
    """What one compaction of a level's file did."""

    records: int = 0  # freed records whose blocks were given back
    bytes_before: int = 0  # disk the file took before (st_blocks)
    bytes_after: int = 0
    seconds: float = 0.0
    supported: bool = True  # False: the file system punches no holes
    stopped: bool = False  # told to stop before the last run

    def as_dict(self) -> dict[str, int | float | bool]:
        return {"records": self.records, "bytes_before": self.bytes_before,
                "bytes_after": self.bytes_after, "seconds": round(self.seconds, 4),
                "supported": self.supported, "stopped": self.stopped}


def runs(slots: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted slots as (first, count) runs of adjacent slots."""
    out: list[tuple[int, int]] = []
    for slot in sorted(slots):
        if out and out[-1][0] + out[-1][1] == slot:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((slot, 1))
    return out


def punch_freed(fd: int, freed: set[int], record_bytes: int, committed: Callable[[], int],
                should_stop: Callable[[], bool] = lambda: False) -> CompactResult:
    """Punch holes over the runs of `freed` (removing each run's slots from it once given back)."""
    started = time.perf_counter()
    result = CompactResult(bytes_before=committed())
    for first, count in runs(freed):
        if should_stop():
            result.stopped = True
            break
        if not punch_hole(fd, first * record_bytes, count * record_bytes):
            result.supported = False
            break
        freed.difference_update(range(first, first + count))
        result.records += count
    result.bytes_after = committed()
    result.seconds = time.perf_counter() - started
    return result
