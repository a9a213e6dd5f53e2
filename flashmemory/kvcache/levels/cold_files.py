"""Cold-zone files and their owners: a live process holds an exclusive lock on its file; files left behind by
processes that died (kill -9, a power cut) are found by their free lock and removed at start-up — never the file
of another live process."""

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

log = logging.getLogger(__name__)

FILE_GLOB = "kv-*.cold"
TEMP_DIR_PREFIX = "flashmemory-cold-"


def hold(fd: int) -> None:
    """Mark the open file as owned by this process for as long as the descriptor is open."""
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _is_orphan(path: Path) -> bool:
    """True when no live process holds the file's lock (it is left over from a dead one)."""
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
        log.info("removed %d cold-zone file(s) left behind by processes that died, in %s", len(removed), folder)
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
