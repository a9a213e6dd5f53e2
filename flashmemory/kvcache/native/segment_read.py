"""The disk level's batched segment read through the native kernel (csrc/segment_read.c): pread and CRC-32 check of
many layer segments in one call. DiskPool's per-segment Python read is the reference and the fallback (and the
path that raises and counts a failure)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from flashmemory.kvcache.native.loader import library

# FM_SEGMENT_* in the C source
FAILURE_REASONS = {1: "truncated", 2: "checksum", 3: "io"}


@dataclass
class SegmentReadFailure:
    """The first segment that did not read back as written: its index in the request and why."""

    index: int
    reason: str  # "truncated", "checksum" or "io"
    errno: int = 0


def native_read_segments(fd: int, offsets: np.ndarray, segment_bytes: int, expected_crcs: np.ndarray,
                         out: np.ndarray) -> SegmentReadFailure | None:
    """Read len(offsets) segments of segment_bytes into out [n, segment_bytes] uint8 and check each CRC-32.
    Returns None when all are good, the first failure otherwise. Only plugged in where the kernels are built
    (use_native_reads)."""
    lib = library()
    assert lib is not None, "the native kernels are not built: read segment by segment"
    n = len(offsets)
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    expected_crcs = np.ascontiguousarray(expected_crcs, dtype=np.uint32)
    assert out.dtype == np.uint8 and out.flags.c_contiguous and out.size >= n * segment_bytes
    reason, err = ctypes.c_int32(0), ctypes.c_int32(0)
    failed = lib.fm_read_segments(fd, n, offsets.ctypes.data, segment_bytes, out.ctypes.data, expected_crcs.ctypes.data,
                                  ctypes.byref(reason), ctypes.byref(err))
    if failed < 0:
        return None
    return SegmentReadFailure(int(failed), FAILURE_REASONS.get(reason.value, "io"), err.value)


def native_crc32(data: np.ndarray) -> int | None:
    """zlib.crc32 of a contiguous uint8 array through the kernel's table (None without the kernel): for tests."""
    lib = library()
    if lib is None:
        return None
    data = np.ascontiguousarray(data, dtype=np.uint8)
    return int(lib.fm_crc32(data.ctypes.data, data.size))


def use_native_reads(level: object) -> None:
    """Give a level that reads segments from a file (anything with `use_batch_read`, i.e. the disk level) the
    kernel's batched read, where the kernel is built."""
    if level is not None and hasattr(level, "use_batch_read") and library() is not None:
        level.use_batch_read(native_read_segments)
