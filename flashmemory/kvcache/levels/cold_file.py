"""ColdFile: the one open file behind the disk level, from its creation to its replacement.

Private scratch space is a file named after its process in cold_zone_dir (or in a private
temporary folder), removed on close; a persistent cold zone (persist_cache) is the stable
kv-cache.cold of a checked folder (cache_folder.py), locked while open, kept for the next process.

A file deleted under a running process (nlink 0: `rm`, a cleaner) still reads and writes through
our descriptor, so nothing is lost at once. It is replaced by a new file at the same place (its
folder made again if it went too) with the live records copied over, so the cache is visible,
bounded and persistent again. While no new file can be made (no space, the folder cannot be made
again) the deleted one keeps serving, `failed` says why without naming a path (the public /health
shows it; the log has the path), and a new try is made at most every `retry_interval_s`.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from flashmemory.errors import ConfigError
from flashmemory.kvcache.levels import cold_files
from flashmemory.kvcache.levels.cache_folder import CacheFolder

PERSISTENT_NAME = "kv-cache.cold"  # the file of a persistent cold zone (persist_cache)
RETRY_INTERVAL_S = 5.0  # a deleted file that could not be replaced: the next try this much later
COPY_CHUNK_BYTES = 1 << 20

logger = logging.getLogger(__name__)


class ColdFile:
    """Owns the disk level's file descriptor (and those of files deleted under it), its folder and
    the lock that keeps writes out of a file being replaced."""

    def __init__(self, size_bytes: int, directory: str | os.PathLike | None,
                 persistent: bool) -> None:
        self.size_bytes = size_bytes
        self.persistent = persistent
        self.folder: CacheFolder | None = None  # the checked folder of a persistent file
        self.secret = b""  # a persistent file's MAC key (kept in its folder; record_mac.py)
        self._owned_dir: tempfile.TemporaryDirectory | None = None
        self.lock = threading.RLock()  # held by a replacement and around every write
        self._retired_fds: list[int] = []  # deleted files: a reader may still be reading one
        self.failed: str | None = None  # why the file in use has no name (not replaceable)
        self.retry_interval_s = RETRY_INTERVAL_S
        self._retry_at = 0.0
        self.num_recreated = 0
        self.fd = -1
        if persistent:
            self._open_persistent(Path(directory) if directory is not None else None)
        else:
            self._open_private(directory)

    # ---- opening -----------------------------------------------------------------------------

    def _open_private(self, directory: str | os.PathLike | None) -> None:
        if directory is None:
            root = cold_files.default_root()
            try:
                root.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ConfigError(f"cannot create the cold-zone folder {root} ({e.strerror}); set "
                                  "cold_zone_dir to a writable folder or cold_zone_enabled=False"
                                  ) from e
            cold_files.remove_orphan_temp_dirs(root)
            self._owned_dir = tempfile.TemporaryDirectory(prefix=cold_files.TEMP_DIR_PREFIX,
                                                          dir=root)
            directory = self._owned_dir.name
        folder = Path(directory)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            cold_files.remove_orphans(folder)
            self.fd, self.path = self._new_private_file(folder)
        except OSError as e:
            raise ConfigError(f"cold_zone_dir {str(folder)!r} is not writable or too small "
                              f"({e.strerror}); choose another folder, lower the cold-zone "
                              "capacity or set cold_zone_enabled=False") from e

    def _open_persistent(self, folder: Path | None) -> None:
        """Open (or create) the folder's stable file and lock it: one process per folder."""
        if folder is None:
            raise ConfigError("persist_cache needs a cold_zone_dir: the folder whose cache "
                              "survives restarts")
        self.folder = CacheFolder(folder)
        self.path = folder / PERSISTENT_NAME
        try:
            self.fd = self.folder.open_or_replace(PERSISTENT_NAME, os.O_RDWR)
        except ConfigError:
            self.close()
            raise
        except OSError as e:
            self.close()
            raise ConfigError(f"cold_zone_dir {str(folder)!r} is not writable ({e.strerror}); "
                              "choose another folder") from e
        try:
            cold_files.hold(self.fd)
        except OSError:
            self.close()
            raise ConfigError(f"cold_zone_dir {str(folder)!r} is in use by another running "
                              "FlashMemory process (its persistent cache is locked); give each "
                              "server its own cold_zone_dir") from None
        try:
            os.ftruncate(self.fd, self.size_bytes)  # grown or shrunk to this capacity
            self.secret = self.folder.secret()
        except OSError as e:
            self.close()
            raise ConfigError(f"cannot size the cold zone file {self.path} to {self.size_bytes} "
                              f"bytes, or keep its key: {e.strerror}; lower cold_zone_gb or free "
                              "disk space") from e
        except ConfigError:
            self.close()
            raise

    def _new_private_file(self, folder: Path) -> tuple[int, Path]:
        fd, name = tempfile.mkstemp(prefix=cold_files.file_prefix(), suffix=".cold", dir=folder)
        return self._sized_and_held(fd), Path(name)

    def _new_persistent_file(self) -> int:
        assert self.folder is not None
        if self.folder.gone():  # the whole folder was removed: made again, checked as at start
            folder = CacheFolder(self.folder.path)
            folder.num_refused = self.folder.num_refused
            self.folder.close()
            self.folder = folder
            folder.keep_secret(self.secret)
        self.folder.remove(PERSISTENT_NAME)  # whatever took its name: the folder is ours alone
        fd = self.folder.open(PERSISTENT_NAME, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        return self._sized_and_held(fd)

    def _sized_and_held(self, fd: int) -> int:
        try:
            cold_files.hold(fd)
            os.ftruncate(fd, self.size_bytes)  # sparse: disk is used as blocks are written
        except OSError:
            os.close(fd)
            raise
        return fd

    # ---- a file deleted under us -------------------------------------------------------------

    def linked(self) -> bool:
        """The file still has a name (0 links: deleted, yet readable through our descriptor)."""
        return os.fstat(self.fd).st_nlink > 0

    def ensure(self, live_ranges: Callable[[], list[tuple[int, int]]]) -> bool:
        """If the file was deleted under us, move to a new one holding the byte ranges
        `live_ranges()` names (the records in use), copied from the deleted file; True when this
        call found it deleted."""
        if self.fd < 0 or (self.failed is None and self.linked()):  # closed, or still there
            return False
        with self.lock:
            found = self.failed is None and not self.linked()
            if found:
                logger.warning(
                    "the cold-zone file %s was deleted while in use: its blocks move to a "
                    "new file", self.path)
            if found or (self.failed is not None and time.monotonic() >= self._retry_at):
                self._replace(live_ranges())
        return found

    def _replace(self, ranges: list[tuple[int, int]]) -> None:
        try:
            if self.persistent:
                fd, path = self._new_persistent_file(), self.path
            else:  # its folder may be gone too (a temp cleaner): made again, private
                self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                fd, path = self._new_private_file(self.path.parent)
        except (OSError, ConfigError) as e:
            return self._fail(e)
        try:
            _copy(self.fd, fd, ranges)
        except OSError as e:
            os.close(fd)
            if self.folder is not None:
                self.folder.remove(PERSISTENT_NAME)
            else:
                path.unlink(missing_ok=True)
            return self._fail(e)
        self._retired_fds.append(self.fd)  # a reader may be between taking it and reading
        self.fd, self.path = fd, path
        self.failed = None
        self.num_recreated += 1
        logger.warning(
            "the cold zone goes on in a new file, %s (%d records carried over)", self.path,
            len(ranges))

    def _fail(self, e: Exception) -> None:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else "its folder is refused"
        kept = "; the cache will not survive a restart" if self.persistent else ""
        every = f"{self.retry_interval_s:g} s"
        self.failed = (f"the cold-zone file was deleted and cannot be re-created ({reason}): its "
                       "blocks are served from the deleted file meanwhile, whose space is freed "
                       f"only at exit{kept}; a new file is tried every {every}")
        self._retry_at = time.monotonic() + self.retry_interval_s
        logger.error("the cold-zone file %s cannot be re-created: %s", self.path, e)

    # ---- closing -----------------------------------------------------------------------------

    def sync(self) -> None:
        if self.fd >= 0:
            os.fsync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            if self.persistent:
                self.sync()
            os.close(self.fd)
            self.fd = -1
            if not self.persistent:
                try:
                    self.path.unlink()
                except OSError:
                    pass
        for fd in self._retired_fds:
            os.close(fd)
        self._retired_fds.clear()
        if self.folder is not None:
            self.folder.close()
        if self._owned_dir is not None:
            try:
                self._owned_dir.cleanup()
            except OSError:  # deleted under us
                pass
            self._owned_dir = None


def _copy(src: int, dst: int, ranges: list[tuple[int, int]]) -> None:
    """Copy the byte ranges (offset, length) of file `src` to the same offsets of `dst` (a short
    source leaves the rest a hole, which the records' checksums then refuse)."""
    for offset, length in ranges:
        end = offset + length
        while offset < end:
            data = os.pread(src, min(COPY_CHUNK_BYTES, end - offset), offset)
            if not data:
                break
            view = memoryview(data)
            while view:
                written = os.pwrite(dst, view, offset)
                if written <= 0:
                    raise OSError(0, f"the new file accepted none of {len(view)} bytes")
                view, offset = view[written:], offset + written
