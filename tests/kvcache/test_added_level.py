"""A level added to the hierarchy by settings alone: a test-local medium
(tests/kvcache/levels/dict_store.py), its registry line and a kv_levels entry; policy, placement
and the read path carry blocks through it unchanged."""

from __future__ import annotations

import pytest
import torch

from flashmemory import FlashMemoryEngine
from flashmemory.errors import CapacityError, ConfigError
from flashmemory.kvcache.interface import ForwardBatch
from flashmemory.kvcache.tiered import TieredKVCache
from tests.kvcache.levels import dict_store
from tests.kvcache.synthetic import SyntheticSequence, skip_without_native, tiny_config

# L2 keeps a block 16 tokens (two blocks of 8), then it moves to the store; 1 MiB holds 512 FP16
# blocks here.
FOUR_LEVELS = "device_memory,host_memory,disk_file,dict_store:1:fp16:16"


def _run(cache: TieredKVCache, seq: SyntheticSequence, num_tokens: int) -> torch.Tensor:
    cache.add_sequence(seq.seq_id)
    outputs = [seq.forward(cache, a, b) for a, b in ((0, 30), (30, 60))]  # prefill chunks
    outputs += [seq.forward(cache, t, t + 1) for t in range(60, num_tokens)]  # decode steps
    return torch.cat(outputs, dim=1)


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_a_fourth_level_is_one_medium_file_and_a_registry_line(backend, monkeypatch, tmp_path):
    dict_store.register(monkeypatch)
    exact = dict(kv_precision="fp16", selection="exact", cold_zone_dir=str(tmp_path))
    four = TieredKVCache(tiny_config(kv_levels=FOUR_LEVELS, **exact))
    three = TieredKVCache(tiny_config(**exact))
    skip_without_native(four, backend)
    try:
        for cache in (four, three):
            cache.use_attention_backend(backend)
        assert isinstance(four.levels[3], dict_store.DictStore) and len(three.levels) == 3
        seq = SyntheticSequence(1, 120)
        ours, theirs = _run(four, seq, 120), _run(three, seq, 120)
        # Every level holds what the policy's footprint says, the store included.
        fp = four.kv_capacity().footprint(four.num_tokens(1))
        held = [a.num_used for a in four.blocks.allocators.values()]
        assert held == list(fp.blocks) and fp.on(3) == 8
        # The same attention as over three levels (only the order the levels are summed in
        # differs).
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
        assert (ours.double() - seq.reference(0, 120)).abs().max() <= 1e-4
        stats = four.kv_stats()
        assert stats.level("L3").blocks == 8 and stats.level("L3").medium.bytes_read > 0
        flat = four.stats()
        assert flat["bytes_moved_L2->L3"] > 0 and flat["L3_blocks"] == 8
        assert "L3_selected_fraction" in flat
    finally:
        four.close()
        three.close()


def test_a_reused_prefix_comes_back_from_the_added_level(monkeypatch, tmp_path):
    dict_store.register(monkeypatch)
    # No L1 room for cached blocks: their FP16 masters are not kept, so the store is what is left.
    cache = TieredKVCache(tiny_config(kv_levels=FOUR_LEVELS, kv_precision="fp16",
                                      cold_zone_dir=str(tmp_path), prefix_cache_host_mb=0))
    try:
        seq, tokens = SyntheticSequence(1, 120), list(range(120))
        cache.add_sequence(1)
        batch = ForwardBatch.build([(1, 0, 120, tokens)], torch.device("cpu"))
        for layer in range(seq.layers):
            cache.attend(layer, batch, seq.q[layer], seq.k[layer], seq.v[layer])
        cache.commit(batch)
        cache.free_sequence(1)
        assert cache.kv_stats().level("L3").cached_blocks == 8  # the oldest wait in the store
        cache.add_sequence(2)
        assert cache.reuse_prefix(2, tokens) == 112  # every full block but the last token's
        assert cache.kv_stats().level("L3").prefix_hit_blocks == 8
    finally:
        cache.close()


def test_a_full_added_level_names_the_setting_that_sizes_it(monkeypatch, tmp_path):
    dict_store.register(monkeypatch)
    # 4 KiB: two FP16 blocks of the tiny geometry.
    tiny_store = "device_memory,host_memory,disk_file,dict_store:0.004:fp16:8"
    cache = TieredKVCache(tiny_config(kv_levels=tiny_store, kv_precision="fp16",
                                      cold_zone_dir=str(tmp_path)))
    try:
        cache.add_sequence(1)
        with pytest.raises(CapacityError, match="dict_store KV level L3 is full; raise its MIB"):
            SyntheticSequence(1, 120).forward(cache, 0, 120)
    finally:
        cache.close()


BUILT_IN = "device_memory,host_memory,disk_file"


@pytest.mark.parametrize("text, message", [
    ("device_memory,host_memory", "lists 2 levels but the cache has 3 built-in ones"),
    ("device_memory,host_memory:1:fp16:8,disk_file", "is the built-in L1: give only its medium"),
    (BUILT_IN + ",dict_store:1:fp16", "write it as MEDIUM:MIB:PRECISION:AFTER_TOKENS"),
    (BUILT_IN + ",dict_store:x:fp16:8", "MIB must be a number"),
    (BUILT_IN + ",dict_store:1:int3:8", "PRECISION 'int3' is not one of fp16, int4, int2"),
    (BUILT_IN + ",dict_store:0:fp16:8", "MIB must be > 0"),
    (BUILT_IN + ",nowhere:1:fp16:8", "medium 'nowhere' is not a known storage medium"),
])
def test_a_kv_levels_entry_that_cannot_be_read_is_refused_with_its_fix(text, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        TieredKVCache(tiny_config(kv_levels=text, cold_zone_dir=str(tmp_path))).close()


def test_kv_levels_reaches_the_engine_as_a_setting(monkeypatch, tiny_llama):
    dict_store.register(monkeypatch)
    kv = dict(kv_precision="fp16", selection="exact", block_size=8, active_window=16,
              warm_tokens=16, prefill_chunk_tokens=24, cpu_memory_gb=0.01, cold_zone_gb=0.01,
              recent_fp16_tokens=0)
    prompt = torch.randint(3, 300, (90,), generator=torch.Generator().manual_seed(0)).tolist()
    outputs = {}
    for levels in ("", FOUR_LEVELS):
        engine = FlashMemoryEngine(model_path=str(tiny_llama), kv_levels=levels, **kv)
        try:
            outputs[levels] = engine.generate_token_ids(prompt, max_new_tokens=8, ignore_eos=True)
            snapshot = engine.last_kv_snapshot
        finally:
            engine.close()
        expected = ["L0", "L1", "L2", "L3"] if levels else ["L0", "L1", "L2"]
        assert [lv.label for lv in snapshot.levels] == expected
    assert snapshot.level("L3").blocks > 0
    assert outputs[FOUR_LEVELS] == outputs[""]
