"""Peak resident set of this process, without torch (the llama.cpp bench workers import it and must not load torch;
the engine reports it as its peak RSS)."""

from __future__ import annotations

import sys
from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def peak_rss_bytes() -> int:
    """This process's own peak RSS. On Linux VmHWM, not getrusage's ru_maxrss: a child started by vfork + exec
    (Python's subprocess) inherits its parent's peak in ru_maxrss, so a small worker of a big parent reported the
    parent's peak."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    try:
        import resource  # Unix only: imported here so the package imports on Windows
    except ImportError:
        return 0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # kilobytes on Linux, bytes on macOS


def reset_peak_rss() -> bool:
    """Restart the peak at the current RSS (Linux: clear_refs 5), so a later peak_rss_bytes() covers only what
    follows (e.g. decode after a restore's transient buffers are freed). False where it cannot."""
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False
