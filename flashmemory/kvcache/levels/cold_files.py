"""Cold-zone files and their owners: a live process names its file after its pid and holds an exclusive lock on it;
files left behind by processes that died (kill -9, a power cut) are found by a dead pid and a free lock, and removed
at start-up — never the file of another live process, nor a file this naming did not make (older versions')."""

from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: an open file cannot be deleted, which protects live files the same way
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

FILE_GLOB = "kv-*.cold"
TEMP_DIR_PREFIX = "flashmemory-cold-"


def default_root() -> Path:
    """Where the private cold-zone folders go when cold_zone_dir is not set: the FlashMemory cache folder
    (FLASHMEMORY_CACHE_DIR, else ~/.cache/flashmemory), not /tmp, which other programs clean while we run."""
    return Path(os.environ.get("FLASHMEMORY_CACHE_DIR") or Path.home() / ".cache" / "flashmemory") / "cold"


def file_prefix() -> str:
    """The name a new cold-zone file starts with: its owner's pid, so another process can tell whether it lives."""
    return f"kv-{os.getpid()}-"


def _owner_pid(path: Path) -> int | None:
    """The pid in a file's name (kv-<pid>-<random>.cold), or None for a name this module did not make."""
    parts = path.name.split("-")
    return int(parts[1]) if len(parts) >= 3 and parts[1].isdigit() else None


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # no permission to signal it: it exists
        return True
    return True


def hold(fd: int) -> None:
    """Mark the open file as owned by this process for as long as the descriptor is open."""
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _is_orphan(path: Path) -> bool:
    """True when the file's owner is dead and no process holds its lock (it is left over from a dead one)."""
    pid = _owner_pid(path)
    if pid is None or _alive(pid):
        return False
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False
    try:
        if fcntl is None:
            return True  # deleting it will fail if a live process has it open
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # a live owner holds it
        return True
    finally:
        os.close(fd)


def remove_orphans(folder: Path) -> list[Path]:
    """Delete the cold-zone files in `folder` that no live process owns; returns what was removed."""
    removed = []
    for path in sorted(folder.glob(FILE_GLOB)):
        if _is_orphan(path):
            try:
                path.unlink()
                removed.append(path)
            except OSError:
                continue
    if removed:
        logger.info("removed %d cold-zone file(s) left behind by processes that died, in %s",
                    len(removed), folder)
    return removed


def remove_orphan_temp_dirs(temp_root: Path | None = None, min_age_s: float = 60.0) -> list[Path]:
    """Empty the private temporary cold-zone folders of dead processes (the default cold_zone_dir) and delete
    them; a folder with a live owner's file is left alone, and so is one younger than `min_age_s` (its owner may
    be between creating the folder and creating its file)."""
    root = Path(temp_root or tempfile.gettempdir())
    removed = []
    now = time.time()
    for folder in sorted(root.glob(TEMP_DIR_PREFIX + "*")):
        try:
            if not folder.is_dir() or now - folder.stat().st_mtime < min_age_s:
                continue
        except OSError:
            continue
        remove_orphans(folder)
        try:
            folder.rmdir()  # only when empty: a live process's file keeps it
            removed.append(folder)
        except OSError:
            continue
    return removed
