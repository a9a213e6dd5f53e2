"""The cold level never serves a damaged block: flipped byte, truncated file and deleted file are detected.

Every test runs twice: with os.pread/os.pwrite, and with the portable seek-based I/O forced
(FLASHMEMORY_PORTABLE_IO=1, the path a system without positional I/O takes), the engine's disk level included."""

from __future__ import annotations

import os

import pytest
import torch

from flashmemory.errors import ColdBlockError, ConfigError
from flashmemory.kvcache import native
from flashmemory.kvcache.levels.disk_pool import DiskPool
from flashmemory.kvcache.levels.file_io import PORTABLE_ENV
from flashmemory.kvcache.quant import Codec

LAYERS, HEADS, BS, DIM = 3, 2, 16, 32


@pytest.fixture(autouse=True, params=["positional", "portable"])
def io_path(request, monkeypatch) -> bool:
    """Which file I/O every DiskPool of the test uses (the engine's included): True = the seek fallback."""
    portable = request.param == "portable"
    monkeypatch.setenv(PORTABLE_ENV, "1" if portable else "0")
    return portable


@pytest.fixture(params=["per-segment", "batched"])
def pool(tmp_path, io_path, request):
    """A disk pool reading segment by segment, or (where the native kernel is built) in batches."""
    p = DiskPool(Codec(2, BS, 16), num_slots=4, num_layers=LAYERS, num_kv_heads=HEADS, block_size=BS,
                 head_dim=DIM, directory=tmp_path, model_fingerprint=b"model-a")
    assert p.io.portable == io_path
    if request.param == "batched":
        if native.library() is None:
            pytest.skip("no C compiler here: the batched read cannot be built (install cc/gcc)")
        native.use_native_reads(p)
    yield p
    p.close()


def _block(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYERS, HEADS, BS, DIM, generator=g), torch.randn(LAYERS, HEADS, BS, DIM, generator=g)


def test_round_trip_returns_what_was_written(pool):
    k, v = _block(0)
    parts = pool.codec.encode(k, v)
    pool.put(2, parts)
    pool.verify_header(2)
    for layer in range(LAYERS):
        got = pool.get_layer([2], layer)
        for name, tensor in parts.items():
            assert torch.equal(got[name][0], tensor[layer])


def test_a_layer_of_many_slots_reads_as_its_segments_one_by_one(pool):
    for slot in range(4):
        pool.put(slot, pool.codec.encode(*_block(10 + slot)))
    slots = [3, 0, 2, 1, 3]
    got = pool.get_layer(slots, 1)
    assert pool.bytes_read == len(slots) * pool.segment_bytes
    want = pool.unflatten(b"".join(pool.read_segment(slot, 1) for slot in slots), len(slots))
    for name in want:
        assert torch.equal(got[name], want[name])


def test_flipped_byte_in_cold_block_is_detected(pool):
    pool.put(1, pool.codec.encode(*_block(1)))
    offset = 1 * pool.record_bytes + pool.header_bytes + pool.segment_bytes + 5  # inside layer 1's segment
    byte = os.pread(pool._fd, 1, offset)
    os.pwrite(pool._fd, bytes([byte[0] ^ 0x40]), offset)
    pool.get_layer([1], 0)  # layer 0 is intact
    with pytest.raises(ColdBlockError) as e:
        pool.get_layer([1], 1)
    assert e.value.reason == "checksum" and pool.load_failures["checksum"] == 1


def test_truncated_cold_file_is_detected(pool):
    pool.put(3, pool.codec.encode(*_block(2)))
    os.truncate(pool.path, 3 * pool.record_bytes + pool.header_bytes + 10)
    with pytest.raises(ColdBlockError) as e:
        pool.get_layer([3], LAYERS - 1)
    assert e.value.reason == "truncated" and pool.load_failures["truncated"] == 1


def test_deleted_cold_file_is_recreated_with_its_blocks(pool):
    parts = pool.codec.encode(*_block(3))
    pool.put(0, parts)
    deleted = pool.path
    os.unlink(deleted)
    got = pool.get_layer([0], 1)  # served, then from a new file holding the block
    assert torch.equal(got["codes"][0], parts["codes"][1])
    assert pool.path.exists() and os.fstat(pool._fd).st_nlink == 1
    assert pool.counters()["file_recreated"] == 1
    pool.put(1, pool.codec.encode(*_block(4)))  # new blocks go to the new file
    assert os.path.getsize(pool.path) == pool.num_slots * pool.record_bytes
    assert pool.health() is None


def test_a_closed_pool_reports_its_file_missing(pool):
    pool.put(0, pool.codec.encode(*_block(3)))
    pool.close()
    with pytest.raises(ColdBlockError) as e:
        pool.get_layer([0], 0)
    assert e.value.reason == "missing" and pool.load_failures["missing"] == 1


def test_freed_slot_is_never_read_back(pool):
    pool.put(0, pool.codec.encode(*_block(4)))
    pool.free(0)
    with pytest.raises(ColdBlockError):
        pool.get_layer([0], 0)
    with pytest.raises(ColdBlockError):
        pool.verify_header(0)


def test_header_of_another_model_is_rejected(pool, tmp_path):
    pool.put(0, pool.codec.encode(*_block(5)))
    other = DiskPool(Codec(2, BS, 16), 4, LAYERS, HEADS, BS, DIM, tmp_path, b"model-b")
    try:
        with open(pool.path, "rb") as f:
            record = f.read(pool.record_bytes)
        os.pwrite(other._fd, record, 0)
        with pytest.raises(ColdBlockError, match="model mismatch"):
            other.verify_header(0)
    finally:
        other.close()


def test_unwritable_cold_zone_dir_is_a_config_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="cold_zone_dir"):
        DiskPool(Codec(2, BS, 16), 1, LAYERS, HEADS, BS, DIM, blocker / "sub", b"m")


def test_engine_reports_a_corrupt_cold_block_instead_of_serving_it(tiny_llama, tmp_path, io_path):
    from flashmemory import FlashMemoryEngine

    engine = FlashMemoryEngine(model_path=str(tiny_llama), block_size=8, active_window=16, warm_tokens=16,
                               cold_zone_dir=str(tmp_path), cold_zone_gb=0.01)
    engine.cache.add_sequence(1)
    engine.forward_tokens(1, list(range(3, 90)))
    pool = engine.cache.disk_pool
    assert pool.bytes_written > 0 and pool.io.portable == io_path
    with open(pool.path, "r+b") as f:  # flip a byte in every written record's payload
        for slot in list(pool._crcs):
            f.seek(slot * pool.record_bytes + pool.header_bytes + 3)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(ColdBlockError):
        engine.forward_tokens(1, [5])
    assert engine.stats()["L2_load_failures_checksum"] >= 1
    engine.cache.free_sequence(1)
    engine.close()
    assert not pool.path.exists()
