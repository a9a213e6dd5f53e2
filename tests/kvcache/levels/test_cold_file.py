"""A cold-zone file deleted under a running process loses nothing: a new file takes its place
with the blocks carried over; while none can be made, the deleted one keeps serving and health
says why, without a path."""

from __future__ import annotations

import errno
import os
import shutil

import pytest
import torch

from flashmemory.errors import ColdBlockError, ColdZoneFullError
from flashmemory.kvcache.levels.cache_folder import KEY_NAME
from flashmemory.kvcache.levels.cold_file import ColdFile
from flashmemory.kvcache.levels.disk_pool import DiskPool
from flashmemory.kvcache.quant import Codec

LAYERS, HEADS, BS, DIM = 2, 2, 8, 16


def _pool(folder, persistent: bool) -> DiskPool:
    return DiskPool(Codec(2, BS, 16), 4, LAYERS, HEADS, BS, DIM, folder, b"model",
                    persistent=persistent)


def _raise(error: Exception):
    def fail(*args, **kwargs):
        raise error
    return fail


def _parts(pool, seed: int):
    g = torch.Generator().manual_seed(seed)
    return pool.codec.encode(torch.randn(LAYERS, HEADS, BS, DIM, generator=g),
                             torch.randn(LAYERS, HEADS, BS, DIM, generator=g))


def _same(pool, slot: int, parts) -> bool:
    got = pool.read_block(slot)
    return all(torch.equal(got[name], parts[name]) for name in parts)


@pytest.mark.parametrize("persistent", [False, True])
def test_deleted_cold_file_is_recreated_with_the_blocks_it_held(tmp_path, persistent):
    pool = _pool(tmp_path, persistent)
    written = {slot: _parts(pool, slot) for slot in (0, 2)}
    for slot, parts in written.items():
        pool.put(slot, parts, name=slot + 1)
    os.unlink(pool.path)
    assert all(_same(pool, slot, parts) for slot, parts in written.items())
    assert pool.path.exists() and pool.counters()["file_recreated"] == 1 and pool.health() is None
    with open(pool.path, "rb") as f:  # the new file holds the records, not only our descriptor
        f.seek(2 * pool.record_bytes)
        assert pool.shape.parse(f.read(pool.header_bytes))[0] == 3
    pool.close()


def test_a_persistent_folder_deleted_whole_is_made_again_with_its_key(tmp_path):
    folder = tmp_path / "kv"
    pool = _pool(folder, persistent=True)
    key = (folder / KEY_NAME).read_bytes()
    parts = _parts(pool, 1)
    pool.put(1, parts, name=7)
    shutil.rmtree(folder)
    assert pool.health() is None and _same(pool, 1, parts)
    assert (folder / KEY_NAME).read_bytes() == key  # what it signs stays verifiable
    assert folder.stat().st_mode & 0o777 == 0o700
    pool.close()


@pytest.mark.parametrize("persistent", [False, True])
def test_deleted_cold_file_not_recreatable_says_degraded_then_recovers(tmp_path, persistent,
                                                                        monkeypatch):
    pool = _pool(tmp_path, persistent)
    parts = _parts(pool, 0)
    pool.put(0, parts, name=1)
    no_space = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    new_file = "_new_persistent_file" if persistent else "_new_private_file"
    monkeypatch.setattr(ColdFile, new_file, _raise(no_space))
    os.unlink(pool.path)
    reason = pool.health()
    assert reason is not None and "cannot be re-created (No space left on device)" in reason
    assert str(tmp_path) not in reason and pool.counters()["failed"] == 1
    assert _same(pool, 0, parts)  # still served, from the deleted file
    pool.put(1, _parts(pool, 1), name=2)  # and it still takes blocks
    monkeypatch.undo()
    assert pool.health() is not None  # not retried before retry_interval_s
    pool.file.retry_interval_s = 0.0
    pool.file._retry_at = 0.0
    assert pool.health() is None and pool.path.exists() and pool.counters()["failed"] == 0
    assert _same(pool, 0, parts) and _same(pool, 1, _parts(pool, 1))
    pool.close()


def test_cold_zone_error_messages_name_no_file(tmp_path, monkeypatch):
    pool = _pool(tmp_path, persistent=False)
    messages = []
    pool.put(0, _parts(pool, 0))
    os.truncate(pool.path, pool.header_bytes + 10)
    for read in (lambda: pool.get_layer([0], 1), lambda: pool.get_layer([3], 0)):
        with pytest.raises(ColdBlockError) as e:
            read()
        messages.append(str(e.value))
    pool.put(1, _parts(pool, 1))
    with open(pool.path, "r+b") as f:
        f.seek(pool.record_bytes + pool.header_bytes)
        f.write(b"\xff" * 8)
    with pytest.raises(ColdBlockError) as e:
        pool.get_layer([1], 0)
    messages.append(str(e.value))
    for err in (errno.ENOSPC, errno.EIO):
        monkeypatch.setattr(pool.io, "pwrite", _raise(OSError(err, "boom")))
        with pytest.raises((ColdZoneFullError, OSError)) as e:
            pool.put(2, _parts(pool, 2))
        messages.append(str(e.value))
    pool.close()
    with pytest.raises(ColdBlockError) as e:
        pool.get_layer([1], 0)
    messages.append(str(e.value))
    with_path = [m for m in messages if str(tmp_path) in m or ".cold" in m]
    assert len(messages) == 6 and not with_path, messages
