"""The disk level's batched read kernel: zlib's CRC-32, and the first bad segment reported with its reason."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest

from flashmemory.kvcache import native
from flashmemory.kvcache.native.segment_read import native_crc32, native_read_segments

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler: the kernels cannot be built here")


@pytest.mark.parametrize("size", [0, 1, 7, 8, 9, 63, 2304, 4099])
def test_crc32_equals_zlib(size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    assert native_crc32(data) == zlib.crc32(data.tobytes())


def _file(tmp_path, segments: list[bytes]) -> int:
    path = tmp_path / "segments"
    path.write_bytes(b"".join(segments))
    return os.open(path, os.O_RDONLY)


def test_segments_are_read_at_their_offsets_and_the_first_bad_one_is_named(tmp_path):
    rng = np.random.default_rng(0)
    segments = [rng.integers(0, 256, 96, dtype=np.uint8).tobytes() for _ in range(4)]
    fd = _file(tmp_path, segments)
    try:
        crcs = np.array([zlib.crc32(s) for s in segments], dtype=np.uint32)
        order = [2, 0, 3]
        out = np.zeros((3, 96), dtype=np.uint8)
        assert native_read_segments(fd, np.array(order) * 96, 96, crcs[order], out) is None
        assert out.tobytes() == b"".join(segments[i] for i in order)
        bad = crcs[order].copy()
        bad[1] ^= 1
        failure = native_read_segments(fd, np.array(order) * 96, 96, bad, out)
        assert (failure.index, failure.reason) == (1, "checksum")
        failure = native_read_segments(fd, np.array([1, 4]) * 96, 96, crcs[[1, 0]], out)  # past the end
        assert (failure.index, failure.reason) == (1, "truncated")
    finally:
        os.close(fd)
