"""The disk level under faults: a full disk is a typed, counted error with nothing half-written; short writes are
completed; the portable (seek-based) I/O path gives the same bytes; files of dead processes are cleaned up, a live
process's never."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from flashmemory.errors import ColdBlockError, ColdZoneFullError, ColdZoneWriteError
from flashmemory.kvcache.levels import cold_files
from flashmemory.kvcache.levels.disk_pool import DiskPool
from flashmemory.kvcache.levels.file_io import PositionalIO
from flashmemory.kvcache.quant import Codec

LAYERS, HEADS, BS, DIM = 2, 2, 8, 32


class FaultyIO(PositionalIO):
    """Fails or shortens writes on demand."""

    def __init__(self, portable: bool = False) -> None:
        super().__init__(portable)
        self.fail_with: int | None = None  # errno of the next writes
        self.short = False  # the OS accepts only part of each write

    def pwrite(self, fd: int, data: bytes, offset: int) -> None:
        if self.fail_with is not None:
            raise OSError(self.fail_with, os.strerror(self.fail_with))
        if self.short:
            real = os.pwrite

            def half(fd_, view, off):  # at most half of what is asked, at least one byte
                return real(fd_, bytes(view[: max(1, len(view) // 2)]), off)

            os.pwrite, restore = half, real
            try:
                return super().pwrite(fd, data, offset)
            finally:
                os.pwrite = restore
        return super().pwrite(fd, data, offset)


def _pool(tmp_path, io=None) -> DiskPool:
    return DiskPool(Codec(2, BS, 16), num_slots=4, num_layers=LAYERS, num_kv_heads=HEADS, block_size=BS,
                    head_dim=DIM, directory=tmp_path, model_fingerprint=b"m", io=io)


def _parts(pool: DiskPool, seed: int):
    g = torch.Generator().manual_seed(seed)
    return pool.codec.encode(torch.randn(LAYERS, HEADS, BS, DIM, generator=g),
                             torch.randn(LAYERS, HEADS, BS, DIM, generator=g))


def test_a_full_disk_is_a_typed_counted_error_and_the_slot_serves_nothing(tmp_path):
    io = FaultyIO()
    pool = _pool(tmp_path, io)
    pool.put(1, _parts(pool, 0))
    io.fail_with = errno.ENOSPC
    with pytest.raises(ColdZoneFullError, match="disk is full"):
        pool.put(1, _parts(pool, 1))  # a rewrite that fails: the old block must not be served either
    assert pool.write_failures["full"] == 1 and pool.counters()["write_failures_full"] == 1
    with pytest.raises(ColdBlockError):
        pool.get_layer([1], 0)
    io.fail_with = errno.EIO
    with pytest.raises(ColdZoneWriteError):
        pool.put(2, _parts(pool, 2))
    assert pool.write_failures["io"] == 1
    pool.close()


def test_short_writes_are_completed_not_accepted(tmp_path):
    io = FaultyIO()
    io.short = True
    pool = _pool(tmp_path, io)
    parts = _parts(pool, 3)
    pool.put(0, parts)
    got = pool.get_layer([0], 1)
    assert all(torch.equal(got[name][0], parts[name][1]) for name in parts)
    pool.close()


def test_the_portable_io_path_reads_and_writes_the_same_bytes(tmp_path):
    native, portable = _pool(tmp_path / "a"), _pool(tmp_path / "b", PositionalIO(portable=True))
    for pool in (native, portable):
        pool.put(2, _parts(pool, 4))
        pool.verify_header(2)
    for layer in range(LAYERS):
        assert native.read_segment(2, layer) == portable.read_segment(2, layer)
    native.close()
    portable.close()


def test_a_full_disk_while_demoting_releases_the_slot_and_keeps_the_block_in_host_memory(tmp_path):
    from flashmemory.kvcache.tiered import TieredKVCache
    from tests.kvcache.synthetic import SyntheticSequence, tiny_config

    cache = TieredKVCache(tiny_config(cold_zone_dir=str(tmp_path)))
    io = FaultyIO()
    cache.disk_pool.io = io
    seq = SyntheticSequence(0, 60)
    cache.add_sequence(0)
    seq.forward(cache, 0, 40)  # 5 blocks: window 2 + warm 2, none in L2 yet
    used = {level: a.num_used for level, a in cache.blocks.allocators.items()}
    io.fail_with = errno.ENOSPC
    with pytest.raises(ColdZoneFullError) as e:
        seq.forward(cache, 40, 48)  # the sixth block pushes the oldest unpinned one out of the warm span
    assert e.value.seq_id == 0  # the cache names the sequence it was serving
    assert cache.blocks.allocators[cache.disk_pool.level].num_used == used[cache.disk_pool.level]  # no slot leaked
    assert cache.stats()["L2_write_failures_full"] == 1
    cache.close()


_ORPHAN = textwrap.dedent("""
    import os, sys
    from flashmemory.kvcache.levels.disk_pool import DiskPool
    from flashmemory.kvcache.quant import Codec
    pool = DiskPool(Codec(2, 8, 16), 4, 2, 2, 8, 32, sys.argv[1], b"m")
    print(pool.path, flush=True)
    os._exit(0)  # as after kill -9: no close, no cleanup
""")


def test_files_of_dead_processes_are_removed_and_live_ones_kept(tmp_path):
    out = subprocess.run([sys.executable, "-c", _ORPHAN, str(tmp_path)], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    orphan = tmp_path / os.path.basename(out.stdout.strip())
    assert orphan.exists()
    live = _pool(tmp_path)  # starting a cold zone in the folder cleans it
    assert not orphan.exists() and live.path.exists()
    other = _pool(tmp_path)  # a second live pool in the same folder leaves the first alone
    assert live.path.exists()
    assert cold_files.remove_orphans(tmp_path) == []
    live.close()
    other.close()


def test_orphan_temp_folders_are_removed_but_young_or_owned_ones_kept(tmp_path):
    dead = tmp_path / (cold_files.TEMP_DIR_PREFIX + "dead")
    dead.mkdir()
    (dead / "kv-999999999-x.cold").write_bytes(b"\0" * 10)  # named after a pid no process has
    owned = tmp_path / (cold_files.TEMP_DIR_PREFIX + "owned")
    owned.mkdir()
    pool = _pool(owned)
    young = tmp_path / (cold_files.TEMP_DIR_PREFIX + "young")
    young.mkdir()
    for folder in (dead, owned):
        os.utime(folder, (0, 0))
    removed = cold_files.remove_orphan_temp_dirs(tmp_path)
    assert removed == [dead] and owned.exists() and young.exists() and pool.path.exists()
    pool.close()


def test_a_file_not_named_after_its_owner_is_never_removed(tmp_path):
    older = tmp_path / "kv-abc123.cold"  # an older version's name: whether its owner lives cannot be told
    older.write_bytes(b"\0" * 10)
    assert cold_files.remove_orphans(tmp_path) == [] and older.exists()
