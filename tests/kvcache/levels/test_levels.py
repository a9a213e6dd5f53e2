"""Every storage medium in the registry honours the StorageLevel protocol, each tested alone (no model, no cache)."""

from __future__ import annotations

import pytest
import torch

from flashmemory.kvcache.config import TieredCacheConfig, level_codecs
from flashmemory.kvcache.levels.protocol import StorageLevel
from flashmemory.kvcache.levels.registry import MEDIA
from flashmemory.kvcache.manager.blocks import Level

LAYERS, HEADS, BS, DIM, SLOTS = 3, 2, 8, 32, 6
MEDIUM_LEVEL = {"device_memory": Level.DEVICE, "host_memory": Level.HOST, "disk_file": Level.DISK}


@pytest.fixture(params=sorted(MEDIA))
def level(request, tmp_path) -> StorageLevel:
    cfg = TieredCacheConfig(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
                            device_slots=SLOTS, host_slots=SLOTS, disk_slots=SLOTS, block_size=BS,
                            cold_zone_dir=str(tmp_path), model_fingerprint=b"test")
    which = MEDIUM_LEVEL[request.param]
    codec = level_codecs("mixed", BS, DIM)[which]
    built = MEDIA[request.param](which, codec, SLOTS, cfg)
    yield built
    built.close()


def _block(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYERS, HEADS, BS, DIM, generator=g), torch.randn(LAYERS, HEADS, BS, DIM, generator=g)


def test_it_is_a_storage_level(level):
    assert isinstance(level, StorageLevel)
    assert level.capacity_bytes == SLOTS * level.bytes_per_slot
    assert level.bytes_per_slot == LAYERS * level.segment_bytes


def test_a_block_reads_back_as_written_by_layer_and_whole(level):
    parts = {slot: level.codec.encode(*_block(slot)) for slot in (1, 4)}
    for slot, p in parts.items():
        level.put(slot, p)
    for layer in range(LAYERS):
        got = level.read_layer([4, 1], layer)  # [heads, n, ...]
        for name, tensor in parts[4].items():
            assert got[name].shape[:2] == (HEADS, 2)
            assert torch.equal(got[name][:, 0].cpu(), tensor[layer].to(got[name].dtype))
            assert torch.equal(got[name][:, 1].cpu(), parts[1][name][layer].to(got[name].dtype))
    whole = level.read_block(1)  # [layers, heads, ...]
    for name, tensor in parts[1].items():
        assert torch.equal(whole[name].cpu(), tensor.to(whole[name].dtype))


def test_raw_segments_decode_to_the_same_parts(level):
    level.put(2, level.codec.encode(*_block(7)))
    data = level.read_segment(2, 1) + level.read_segment(2, 1)
    assert len(data) == 2 * level.segment_bytes
    parts = level.parts_from_segments(data, 2)  # [n, heads, ...]
    direct = level.read_layer([2], 1)
    for name, tensor in direct.items():
        assert torch.equal(parts[name][0].cpu(), tensor[:, 0].cpu())


def test_generation_moves_on_before_a_slot_changes(level):
    g0 = level.generation_of(3)
    level.put(3, level.codec.encode(*_block(3)))
    g1 = level.generation_of(3)
    level.free(3)
    g2 = level.generation_of(3)
    assert g0 < g1 < g2
    assert level.generation_of(0) == g0  # other slots untouched


def test_counters_are_numbers_and_the_medium_checks_itself(level):
    level.check_medium()
    assert all(isinstance(v, int) for v in level.counters().values())
