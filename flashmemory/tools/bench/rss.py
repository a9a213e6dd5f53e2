"""Peak resident set of this process, without torch (the llama.cpp workers must not load it to measure it)."""

from __future__ import annotations

import resource
import sys


def peak_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # kilobytes on Linux, bytes on macOS
