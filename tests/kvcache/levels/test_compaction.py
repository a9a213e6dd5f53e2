"""Compaction of the disk level: the disk blocks of freed records are given back (the file's
allocated bytes drop), live records read back unchanged, a rewritten slot is never punched, a
compaction told to stop stops, and the server compacts while idle."""

from __future__ import annotations

import httpx
import pytest
import torch

from flashmemory.kvcache.levels.compaction import runs
from flashmemory.kvcache.levels.disk_pool import DiskPool
from flashmemory.kvcache.levels.file_io import punch_hole
from flashmemory.kvcache.quant import Codec

LAYERS, HEADS, BS, DIM, SLOTS = 4, 2, 16, 64, 12


@pytest.fixture
def pool(tmp_path):
    p = DiskPool(Codec(4, BS, 16), num_slots=SLOTS, num_layers=LAYERS, num_kv_heads=HEADS,
                 block_size=BS, head_dim=DIM, directory=tmp_path, model_fingerprint=b"model-a")
    probe = tmp_path / "probe"
    probe.write_bytes(b"x" * 8192)
    with open(probe, "r+b") as f:
        if not punch_hole(f.fileno(), 0, 4096):
            pytest.skip("this file system punches no holes (fallocate PUNCH_HOLE)")
    yield p
    p.close()


def _block(seed: int):
    g = torch.Generator().manual_seed(seed)
    return Codec(4, BS, 16).encode(torch.randn(LAYERS, HEADS, BS, DIM, generator=g),
                                   torch.randn(LAYERS, HEADS, BS, DIM, generator=g))


def test_runs_groups_adjacent_slots():
    assert runs({7, 2, 3, 4, 9, 10}) == [(2, 3), (7, 1), (9, 2)]
    assert runs(set()) == []


def test_freed_records_are_given_back_and_live_ones_read_the_same(pool):
    for slot in range(SLOTS):
        pool.put(slot, _block(slot))
    before = {slot: pool.read_block(slot) for slot in (0, 1, 5, 7, 11)}
    for slot in (2, 3, 4, 6, 8, 9, 10):
        pool.free(slot)
    counters = pool.counters()
    assert counters["bytes_reclaimable"] == 7 * pool.record_bytes
    result = pool.compact()
    assert result.supported and not result.stopped and result.records == 7
    assert result.bytes_before - result.bytes_after >= 7 * pool.record_bytes - 4096
    assert pool.counters()["bytes_reclaimable"] == 0
    assert pool.counters()["bytes_reclaimed"] == result.bytes_before - result.bytes_after
    for slot, parts in before.items():
        after = pool.read_block(slot)
        assert all(torch.equal(parts[k], after[k]) for k in parts)
    assert pool.compact().records == 0  # nothing left to give back


def test_a_slot_written_again_after_its_free_is_not_punched(pool):
    pool.put(3, _block(1))
    pool.free(3)
    pool.put(3, _block(2))
    expected = pool.read_block(3)
    assert pool.compact().records == 0
    after = pool.read_block(3)
    assert all(torch.equal(expected[k], after[k]) for k in expected)


def test_a_compaction_told_to_stop_gives_back_nothing_more(pool):
    for slot in (0, 2, 4):
        pool.put(slot, _block(slot))
        pool.free(slot)
    result = pool.compact(lambda: True)
    assert result.stopped and result.records == 0
    assert pool.counters()["bytes_reclaimable"] == 3 * pool.record_bytes


def test_an_idle_server_compacts_its_disk_level(tiny_llama):
    from tests.serve.conftest import TINY_KV, live_server

    kwargs = dict(model_path=str(tiny_llama), **TINY_KV, prefix_caching=False)
    body = {"prompt": "one two three four five six " * 9, "max_tokens": 48, "ignore_eos": True}
    with live_server(kwargs, served_model_name="tiny") as server:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            assert http.post("/v1/completions", json=body).status_code == 200
            stats = server.worker
            assert server.wait_until(lambda: stats.kv_stats.get("L2_bytes_reclaimed", 0) > 0)
            assert server.wait_until(lambda: server.worker.kv_stats["L2_bytes_reclaimable"] == 0)
            metrics = http.get("/metrics").text
            assert 'flashmemory:kv_fragmentation{model_name="tiny",tier="L2"} 0.0' in metrics
