"""The prefix cache across restarts (persist_cache) and named sessions: recovered blocks answer exactly as a fresh
prefill (the exact configuration), anything doubtful is recomputed, never served, and one folder serves one process."""

from __future__ import annotations

import errno
import logging
import os
import zlib

import numpy as np
import pytest

from flashmemory import FlashMemoryEngine
from flashmemory.errors import ConfigError
from flashmemory.kvcache.prefix_store import INDEX_NAME

KNOBS = dict(kv_precision="fp16", selection="exact", block_size=8, active_window=32, warm_tokens=32,
             prefill_chunk_tokens=32, cpu_memory_gb=0.01, cold_zone_gb=0.01, persist_cache=True)
DOCUMENT = "Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to do. "


def _engine(tiny_llama, folder, **extra) -> FlashMemoryEngine:
    return FlashMemoryEngine(model_path=str(tiny_llama), cold_zone_dir=str(folder), **{**KNOBS, **extra})


def test_a_restarted_engine_reuses_the_document_and_answers_the_same(tiny_llama, tmp_path):
    prompt = DOCUMENT * 2 + "What was Alice doing?"
    first = _engine(tiny_llama, tmp_path)
    expected = first.generate(prompt, max_new_tokens=12, ignore_eos=True)
    first.close()  # a clean shutdown writes the cached blocks down and publishes the index
    assert (tmp_path / INDEX_NAME).exists()
    second = _engine(tiny_llama, tmp_path)
    assert second.generate(prompt, max_new_tokens=12, ignore_eos=True) == expected
    stats = second.stats()
    assert stats["prefix_cache_hits"] >= len(second.tokenizer.encode(prompt)) - 16  # all but the last blocks
    assert stats["L2_prefix_hit_blocks"] > 0  # found on disk
    second.close()


def test_another_model_precision_or_block_size_discards_the_old_entries_with_one_log_line(tiny_llama, tmp_path,
                                                                                          caplog):
    first = _engine(tiny_llama, tmp_path)
    first.generate(DOCUMENT * 2, max_new_tokens=4)
    first.close()
    with caplog.at_level(logging.WARNING, logger="flashmemory.kvcache.prefix_store"):
        other = _engine(tiny_llama, tmp_path, kv_precision="mixed")
    assert [r for r in caplog.records if "discarding" in r.getMessage()]
    assert other.stats()["prefix_cache_blocks"] == 0
    other.close()


@pytest.mark.parametrize("other", [{"weights_dtype": "bfloat16"}, {"dtype": "float64"}])
def test_kv_computed_under_other_weights_or_dtype_is_not_reused(tiny_llama, tmp_path, caplog, other):
    first = _engine(tiny_llama, tmp_path)
    first.generate(DOCUMENT * 2, max_new_tokens=4)
    first.close()
    with caplog.at_level(logging.WARNING, logger="flashmemory.kvcache.prefix_store"):
        second = _engine(tiny_llama, tmp_path, **other)
    assert [r for r in caplog.records if "discarding" in r.getMessage()]
    assert second.stats()["prefix_cache_blocks"] == 0
    second.close()


def test_a_saved_session_keeps_its_tokens_when_the_settings_change(tiny_llama, tmp_path):
    first = _engine(tiny_llama, tmp_path)
    first.chat([{"role": "user", "content": DOCUMENT}], max_new_tokens=4, ignore_eos=True)
    first.save_session("alice")
    tokens = first.load_session("alice")
    first.close()
    other = _engine(tiny_llama, tmp_path, kv_quant_range="minmax")  # another namespace: no block is reused
    assert other.stats()["prefix_cache_blocks"] == 0
    assert other.sessions() == ["alice"] and other.load_session("alice") == tokens
    other.generate(tokens + other.tokenizer.encode(" And then?"), max_new_tokens=2)  # recomputed, then saved again
    assert other.save_session("alice", tokens) > 0
    other.close()


def test_a_slot_rewritten_after_the_index_was_saved_is_dropped_not_served(tiny_llama, tmp_path):
    prompt = DOCUMENT * 2 + "Who?"
    first = _engine(tiny_llama, tmp_path)
    expected = first.generate(prompt, max_new_tokens=8, ignore_eos=True)
    record = first.cache.disk_pool.record_bytes
    first.close()
    with np.load(tmp_path / INDEX_NAME) as index:
        slot = int(index["slots"][1])  # the document's second block
    with open(tmp_path / "kv-cache.cold", "r+b") as f:  # a torn write over its header
        f.seek(slot * record + 10)
        f.write(b"\xff" * 8)
    second = _engine(tiny_llama, tmp_path)
    assert second.generate(prompt, max_new_tokens=8, ignore_eos=True) == expected  # recomputed from there on
    assert second.stats()["prefix_cache_hits"] <= 8  # only the first block came back
    second.close()


def test_two_engines_cannot_share_one_persistent_folder(tiny_llama, tmp_path):
    first = _engine(tiny_llama, tmp_path)
    with pytest.raises(ConfigError, match="in use by another running FlashMemory process"):
        _engine(tiny_llama, tmp_path)
    first.close()


def test_persist_cache_without_a_folder_is_a_clear_error(tiny_llama):
    with pytest.raises(ConfigError, match="persist_cache needs a cold_zone_dir"):
        FlashMemoryEngine(model_path=str(tiny_llama), persist_cache=True)


def test_a_saved_session_survives_eviction_and_a_restart(tiny_llama, tmp_path):
    first = _engine(tiny_llama, tmp_path)
    first.chat([{"role": "user", "content": DOCUMENT}], max_new_tokens=8, ignore_eos=True)
    held = first.save_session("alice")
    assert held > 0 and first.sessions() == ["alice"]
    for i in range(6):  # other traffic fills the small levels: the session's blocks stay
        first.generate(f"{i} " + DOCUMENT[::-1] * 2, max_new_tokens=2)
    tokens = first.load_session("alice")
    first.close()
    second = _engine(tiny_llama, tmp_path)
    assert second.sessions() == ["alice"] and second.load_session("alice") == tokens
    second.generate(tokens + second.tokenizer.encode(" And then?"), max_new_tokens=2)
    assert second.stats()["prefix_cache_hits"] >= held
    second.delete_session("alice")
    with pytest.raises(ConfigError, match="no session named 'alice'"):
        second.load_session("alice")
    second.close()


def test_a_malformed_index_never_stops_the_engine_starting(tiny_llama, tmp_path, caplog):
    prompt = DOCUMENT * 2 + "Who?"
    first = _engine(tiny_llama, tmp_path)
    expected = first.generate(prompt, max_new_tokens=8, ignore_eos=True)
    first.close()
    index = tmp_path / INDEX_NAME
    index.write_bytes(index.read_bytes()[: index.stat().st_size // 2])  # torn, or tampered with
    with caplog.at_level(logging.WARNING, logger="flashmemory.kvcache.prefix_store"):
        second = _engine(tiny_llama, tmp_path)  # starts, every time
    lines = [r for r in caplog.records if "discarding the prefix-cache index" in r.getMessage()]
    stats = second.stats()
    assert len(lines) == 1 and stats["persist_index_discarded"] == 1
    assert stats["prefix_cache_blocks"] == 0
    assert second.generate(prompt, max_new_tokens=8, ignore_eos=True) == expected
    second.close()
    third = _engine(tiny_llama, tmp_path)  # the index written at that shutdown is whole again
    stats = third.stats()
    assert stats["persist_index_discarded"] == 0 and stats["persist_records_recovered"] > 0
    third.close()


def test_a_forged_record_with_valid_checksums_is_recomputed_not_served(tiny_llama, tmp_path):
    prompt = DOCUMENT * 2 + "Who?"
    first = _engine(tiny_llama, tmp_path)
    expected = first.generate(prompt, max_new_tokens=8, ignore_eos=True)
    pool = first.cache.disk_pool
    shape, record_bytes, segment = pool.shape, pool.record_bytes, pool.segment_bytes
    layers = pool.num_layers
    first.close()
    with np.load(tmp_path / INDEX_NAME) as index:
        slot, name = int(index["slots"][0]), int.from_bytes(index["names"][0].tobytes(), "little")
    rng = np.random.default_rng(0)
    forged = [rng.integers(0, 256, segment, dtype=np.uint8).tobytes() for _ in range(layers)]
    with open(tmp_path / "kv-cache.cold", "r+b") as f:  # other KV, same name, matching CRCs
        f.seek(slot * record_bytes)
        f.write(shape.pack(name, [zlib.crc32(s) for s in forged]) + b"".join(forged))
    second = _engine(tiny_llama, tmp_path)
    assert second.stats()["persist_records_discarded_unauthenticated"] == 1
    assert second.generate(prompt, max_new_tokens=8, ignore_eos=True) == expected
    second.close()


def test_deleted_cold_file_is_recreated_and_health_says_degraded_then_recovers(
        tiny_llama, tmp_path, monkeypatch):
    from flashmemory.kvcache.levels.cold_file import ColdFile

    prompts = [f"{i} " + DOCUMENT * 2 for i in range(2)]
    engine = _engine(tiny_llama, tmp_path)
    expected = [engine.generate(p, max_new_tokens=8, ignore_eos=True) for p in prompts]
    assert engine.health() == {"status": "ok"}
    no_space = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    def no_new_file(self):
        raise no_space

    monkeypatch.setattr(ColdFile, "_new_persistent_file", no_new_file)
    os.unlink(tmp_path / "kv-cache.cold")
    health = engine.health()
    assert health["status"] == "degraded" and "cannot be re-created" in health["reasons"][0]
    assert str(tmp_path) not in str(health)  # /health is public
    served = [engine.generate(p, max_new_tokens=8, ignore_eos=True) for p in prompts]
    assert served == expected  # from the deleted file
    monkeypatch.undo()
    engine.cache.disk_pool.file._retry_at = 0.0  # the next try is due
    assert engine.health() == {"status": "ok"} and (tmp_path / "kv-cache.cold").exists()
    assert engine.stats()["L2_file_recreated"] == 1
    engine.close()
    again = _engine(tiny_llama, tmp_path)  # what the new file holds survives the restart
    assert [again.generate(p, max_new_tokens=8, ignore_eos=True) for p in prompts] == expected
    stats = again.stats()
    assert stats["persist_records_recovered"] > 0 and stats["L2_prefix_hit_blocks"] > 0
    again.close()
