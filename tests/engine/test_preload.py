"""Preload (seed 004 §4): after a restart a conversation's cached blocks are brought up from the
disk level before its next turn, which then reads none of them from disk and answers the same; a
preload stops when told, counts no prefix-cache queries, and preloads saved sessions by name."""

from __future__ import annotations

import pytest

from flashmemory import FlashMemoryEngine
from flashmemory.errors import ConfigError
from tests.engine.test_prefix_persistence import DOCUMENT, KNOBS

PROMPT = DOCUMENT * 2 + "What was Alice doing?"
FROM_DISK = "bytes_moved_L2->L1"


def _engine(tiny_llama, folder) -> FlashMemoryEngine:
    return FlashMemoryEngine(model_path=str(tiny_llama), cold_zone_dir=str(folder), **KNOBS)


@pytest.fixture
def restarted(tiny_llama, tmp_path):
    """An engine started on a folder where a previous one left PROMPT's blocks (on disk only),
    and what that previous one answered."""
    first = _engine(tiny_llama, tmp_path)
    expected = first.generate(PROMPT, max_new_tokens=12, ignore_eos=True)
    first.save_session("chat", first.last_token_ids)
    first.close()
    engine = _engine(tiny_llama, tmp_path)
    yield engine, expected
    engine.close()


def test_a_preload_after_a_restart_spares_the_next_turn_its_disk_reads(restarted):
    engine, expected = restarted
    assert engine.stats().get(FROM_DISK, 0) == 0
    result = engine.preload(PROMPT)
    assert result.complete and result.blocks == len(engine.tokenizer.encode(PROMPT)) // 8
    assert result.blocks_restored > 0 and result.bytes_copied == engine.stats()[FROM_DISK]
    assert engine.stats()["prefix_cache_queries"] == 0  # a preload is not a query
    read_before = engine.stats()[FROM_DISK]
    assert engine.generate(PROMPT, max_new_tokens=12, ignore_eos=True) == expected
    assert engine.stats()[FROM_DISK] == read_before  # nothing more came from disk


def test_a_preload_restores_nothing_twice_and_nothing_for_an_unknown_prompt(restarted):
    engine, _ = restarted
    assert engine.preload(PROMPT).blocks_restored > 0
    again = engine.preload(PROMPT)
    assert again.complete and again.blocks_restored == 0 and again.bytes_copied == 0
    unknown = engine.preload("Something never said before, about the sea.")
    assert (unknown.blocks, unknown.complete) == (0, True)


def test_a_preload_stops_before_the_next_block_when_told(restarted):
    engine, expected = restarted
    ids = engine.tokenizer.encode(PROMPT)
    result = engine.cache.preload_prefix(ids, lambda: "request")
    assert (result.stopped, result.blocks_restored, result.complete) == ("request", 0, False)
    assert engine.core.num_live == 0 and engine.cache.stats()["num_sequences"] == 0
    assert engine.generate(PROMPT, max_new_tokens=12, ignore_eos=True) == expected


def test_a_saved_session_is_preloaded_by_name(restarted):
    engine, _ = restarted
    result = engine.preload_session("chat")
    assert result.complete and result.blocks_restored > 0
    with pytest.raises(ConfigError, match="no session named 'other'; saved: chat"):
        engine.preload_session("other")
