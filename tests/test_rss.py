"""Peak RSS of a bench worker is the worker's own, not its parent's."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from flashmemory.rss import peak_rss_bytes, reset_peak_rss

MIB = 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM and clear_refs are Linux's")
def test_a_small_child_of_a_big_parent_reports_its_own_peak():
    """getrusage's ru_maxrss of a vfork + exec child starts at the parent's peak; VmHWM does not."""
    ballast = np.ones(400 * MIB // 8)  # the parent's peak: 400 MiB more
    code = "from flashmemory.rss import peak_rss_bytes; print(peak_rss_bytes())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout) < 200 * MIB < ballast.nbytes


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM and clear_refs are Linux's")
def test_reset_peak_rss_drops_a_freed_buffers_peak():
    buffer = np.ones(300 * MIB // 8)
    del buffer
    before = peak_rss_bytes()
    assert reset_peak_rss()
    assert peak_rss_bytes() < before - 200 * MIB
