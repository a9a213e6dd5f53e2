"""CacheFolder: the persistent cache's folder (persist_cache) and the files in it, treated as
ground another program may have touched between two runs.

The folder must belong to the user running FlashMemory and be writable by no one else (anyone
who can write it can plant the files the cache reads back, or links that turn its writes onto
other files). It is opened once, and every file is opened relative to that descriptor, never
through a symbolic link (O_NOFOLLOW): a link (or a hard link, or a file of another user) where a
cache file should be is removed, logged and counted, and a new file made in its place. Files are
created 0600 (they hold the cached prompts' token ids and KV), a temporary one with O_EXCL after
any stale one is removed. The folder also
keeps the cache's secret: 32 random bytes (kv-cache.key, 0600) that authenticate what the cache
writes (record_mac.py); a key that is malformed or readable by others is replaced, which makes
the old cache a miss.

Where the OS lacks O_NOFOLLOW or dir_fd (Windows), a path is opened after an lstat check.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import stat
from pathlib import Path

from flashmemory.errors import ConfigError

logger = logging.getLogger(__name__)

KEY_NAME = "kv-cache.key"
KEY_BYTES = 32
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_AT_FD = os.open in os.supports_dir_fd and bool(_NOFOLLOW)  # relative to the folder's descriptor


class LinkRefusedError(OSError):
    """A cache file's name is a link or not a plain file of ours: it is not opened through."""


def _owned_by_us(st: os.stat_result) -> bool:
    return not hasattr(os, "geteuid") or st.st_uid == os.geteuid()


class CacheFolder:
    """Owns the open descriptor of a checked persistent-cache folder; opens the files in it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.num_refused = 0  # links (or foreign files) found where a cache file should be
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.fd = os.open(path, os.O_RDONLY | _DIRECTORY | _CLOEXEC) if _AT_FD else -1
            st = os.fstat(self.fd) if self.fd >= 0 else os.stat(path)
        except OSError as e:
            raise ConfigError(f"cold_zone_dir {str(path)!r} cannot be opened ({e.strerror}); "
                              "choose a folder you can write") from e
        try:
            self._check_private(st)
        except ConfigError:
            self.close()
            raise

    def _check_private(self, st: os.stat_result) -> None:
        if not stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"cold_zone_dir {str(self.path)!r} is not a folder; choose a folder "
                              "for the cache")
        if not _owned_by_us(st):
            raise ConfigError(f"the persistent cache folder {self.path} belongs to another user "
                              f"(uid {st.st_uid}), who could replace its files; use a folder you "
                              f"own, or chown {os.geteuid()} {self.path}")
        if hasattr(os, "geteuid") and st.st_mode & 0o022:
            mode = stat.S_IMODE(st.st_mode)
            raise ConfigError(f"the persistent cache folder {self.path} is writable by other "
                              f"users (mode {mode:o}): they could plant the files the cache reads "
                              f"back; chmod go-w {self.path} (or use a private folder)")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def gone(self) -> bool:
        """True when the folder itself was deleted (no file can be made in it any more)."""
        try:
            return (os.fstat(self.fd) if self.fd >= 0 else os.stat(self.path)).st_nlink == 0
        except OSError:
            return True

    # ---- files -------------------------------------------------------------------------------

    def open(self, name: str, flags: int, mode: int = 0o600, owner_only: bool = True) -> int:
        """os.open of `name` in the folder, never through a link (LinkRefusedError), nor onto
        anything but a regular file of ours with one name (through a hard link, writes would land
        in another file too); `owner_only`: a file others could read is made 0600."""
        try:
            if _AT_FD:
                fd = os.open(name, flags | _NOFOLLOW | _CLOEXEC, mode, dir_fd=self.fd)
            else:
                if os.path.islink(self.path / name):
                    raise OSError(errno.ELOOP, "a symbolic link")
                fd = os.open(self.path / name, flags | _CLOEXEC | getattr(os, "O_BINARY", 0), mode)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise LinkRefusedError(errno.ELOOP, f"{name} is a symbolic link") from e
            if e.errno == errno.EISDIR:
                raise LinkRefusedError(errno.EISDIR, f"{name} is a folder") from e
            raise
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1 or not _owned_by_us(st):
            os.close(fd)
            what = "not a regular file" if not stat.S_ISREG(st.st_mode) else (
                "a hard link to another file" if st.st_nlink > 1 else "owned by another user")
            raise LinkRefusedError(errno.EPERM, f"{name} is {what}")
        if owner_only and hasattr(os, "fchmod") and stat.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(fd, 0o600)  # an older version's file, or one copied in: owner-only now
        return fd

    def open_or_replace(self, name: str, flags: int) -> int:
        """`open(name, flags | O_CREAT)`; a link or foreign file under that name is not opened
        through but removed (its target untouched), logged and counted, and a new file made.
        ConfigError when it cannot be removed (a folder of that name)."""
        try:
            return self.open(name, flags | os.O_CREAT)
        except LinkRefusedError as e:
            self.num_refused += 1
            logger.warning(
                "%s is refused (%s): the cache never opens its files through a link, which "
                "could turn its writes onto files outside its folder; it is removed and a "
                "new, empty file made (to keep the cache elsewhere, set cold_zone_dir "
                "there)", self.path / name, e.strerror)
        try:
            self.remove(name)
            return self.open(name, flags | os.O_CREAT | os.O_EXCL)
        except OSError as e:
            raise ConfigError(f"{self.path / name} is not a plain file of yours and cannot be "
                              f"removed ({e.strerror}); remove it, or set cold_zone_dir to another "
                              "folder") from None

    def exists(self, name: str) -> bool:
        try:
            if _AT_FD:
                os.stat(name, dir_fd=self.fd, follow_symlinks=False)
            else:
                os.lstat(self.path / name)
        except OSError:
            return False
        return True

    def remove(self, name: str) -> None:
        """Unlink `name` (a link itself, never its target); nothing to do when it is absent."""
        try:
            if _AT_FD:
                os.unlink(name, dir_fd=self.fd)
            else:
                os.unlink(self.path / name)
        except FileNotFoundError:
            pass

    def create_temp(self, name: str) -> int:
        """A new, empty, owner-only file called `name`, write-only: a stale one (a crash mid-save)
        or anything planted under that name is removed first, and O_EXCL makes sure the file
        opened is the one created."""
        self.remove(name)
        return self.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL)

    def replace(self, src: str, dst: str) -> None:
        """Rename `src` over `dst` atomically (a link at `dst` is replaced, not followed), then
        make the rename durable."""
        if _AT_FD:
            os.replace(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd)
            os.fsync(self.fd)
        else:
            os.replace(self.path / src, self.path / dst)

    # ---- the secret --------------------------------------------------------------------------

    def secret(self) -> bytes:
        """The folder's MAC key, made on first use. One that is malformed or readable by others
        is replaced: what was written under it stops being trusted (a miss, recomputed)."""
        try:
            fd = self.open(KEY_NAME, os.O_RDONLY, owner_only=False)
        except FileNotFoundError:
            return self._new_secret()
        except LinkRefusedError as e:
            self.num_refused += 1
            logger.warning(
                "the cache key %s is refused (%s): a new one is made and the cache "
                "written under the old one is discarded", self.path / KEY_NAME, e.strerror)
            return self._new_secret()
        try:
            st = os.fstat(fd)
            key = os.read(fd, KEY_BYTES + 1)
        finally:
            os.close(fd)
        if len(key) != KEY_BYTES:
            logger.warning("the cache key in %s is malformed (%d bytes): a new one is made and the "
                           "cache written under the old one is discarded", self.path, len(key))
            return self._new_secret()
        if hasattr(os, "geteuid") and stat.S_IMODE(st.st_mode) & 0o077:
            logger.warning(
                "the cache key in %s was readable by other users (mode %o): a new one is "
                "made and the cache written under the old one is discarded", self.path,
                stat.S_IMODE(st.st_mode))
            return self._new_secret()
        return key

    def keep_secret(self, key: bytes) -> None:
        """Write `key` as the folder's secret unless one is there (the folder made again under a
        running process: what it writes stays verifiable by the next)."""
        if not self.exists(KEY_NAME):
            self._write_secret(key)

    def _new_secret(self) -> bytes:
        key = secrets.token_bytes(KEY_BYTES)
        self._write_secret(key)
        return key

    def _write_secret(self, key: bytes) -> None:
        tmp = KEY_NAME + ".tmp"
        fd = self.create_temp(tmp)
        try:
            os.write(fd, key)
            os.fsync(fd)
        finally:
            os.close(fd)
        self.replace(tmp, KEY_NAME)
