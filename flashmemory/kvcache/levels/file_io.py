"""Positional file I/O for the disk level: os.pread/os.pwrite where the OS has them, a locked seek then read/write
elsewhere (Windows); a write is complete or raises, never short."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import threading

PORTABLE_ENV = "FLASHMEMORY_PORTABLE_IO"  # 1: the seek-based path even where pread/pwrite exist


class PositionalIO:
    """Reads and writes at an offset without moving a shared file position (or under a lock where it must)."""

    def __init__(self, portable: bool | None = None) -> None:
        # portable=True forces the seek-based path (tests run it on Linux, as does FLASHMEMORY_PORTABLE_IO=1);
        # None picks what the OS offers.
        if portable is None:
            forced = os.environ.get(PORTABLE_ENV, "0").lower() in ("1", "true", "yes", "on")
            portable = forced or not (hasattr(os, "pread") and hasattr(os, "pwrite"))
        self.portable = portable
        self._lock = threading.Lock()

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        """Up to `size` bytes at `offset` (fewer only at the end of the file)."""
        if not self.portable:
            return os.pread(fd, size, offset)
        with self._lock:
            os.lseek(fd, offset, os.SEEK_SET)
            chunks, left = [], size
            while left:
                chunk = os.read(fd, left)
                if not chunk:
                    break
                chunks.append(chunk)
                left -= len(chunk)
            return b"".join(chunks)

    def pwrite(self, fd: int, data: bytes, offset: int) -> None:
        """Write all of `data` at `offset`; an OSError (e.g. ENOSPC) propagates, a write of 0 bytes raises."""
        view = memoryview(data)
        while view:
            if self.portable:
                with self._lock:
                    os.lseek(fd, offset, os.SEEK_SET)
                    written = os.write(fd, view)
            else:
                written = os.pwrite(fd, view, offset)
            if written <= 0:
                raise OSError(0, f"the file accepted none of {len(view)} bytes at offset {offset}")
            view = view[written:]
            offset += written


_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_fallocate: object | None = None


def punch_hole(fd: int, offset: int, length: int) -> bool:
    """Give the file system back the blocks of [offset, offset + length) (they read as zeros; the
    file's size stays): Linux's fallocate(FALLOC_FL_PUNCH_HOLE). False where the OS or the file
    system does not offer it."""
    global _fallocate
    if not sys.platform.startswith("linux"):
        return False
    if _fallocate is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
        _fallocate = libc.fallocate
    mode = _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE
    return _fallocate(fd, mode, offset, length) == 0  # type: ignore[operator]
