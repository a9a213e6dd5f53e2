"""The guardrail in the engine: a flagged output ends with content_filter and frees its KV, a
passing or timed-out guardrail leaves the text as without one, the device budget does not move,
and the other sequences of a batch are not affected."""

from __future__ import annotations

import re

import pytest

from flashmemory import FlashMemoryEngine
from flashmemory.guardrail import loader
from tests.guardrail.fakes import FlagWords, Slow

PROMPTS = ["one two three four", "five six seven"]
OPTS = dict(max_new_tokens=40, ignore_eos=True)


def engine_with(tiny_llama, monkeypatch, classifier, **settings):
    monkeypatch.setattr(loader, "load_guardrail", lambda path, precision: classifier)
    return FlashMemoryEngine(model_path=str(tiny_llama), max_seq_len=128, block_size=8,
                             guardrail_path="toxic-comment-classifier", guardrail_chunk_tokens=4,
                             **settings)


@pytest.fixture(scope="module")
def plain(tiny_llama):
    engine = FlashMemoryEngine(model_path=str(tiny_llama), max_seq_len=128, block_size=8)
    plan = engine.device_plan
    texts = engine.generate(PROMPTS, **OPTS)
    engine.close()
    return texts, plan


def test_a_guardrail_that_passes_everything_changes_no_text(tiny_llama, monkeypatch, plain):
    classifier = FlagWords()
    engine = engine_with(tiny_llama, monkeypatch, classifier)
    assert engine.device_plan == plain[1]  # the guardrail holds no device memory
    try:
        assert engine.generate(PROMPTS, **OPTS) == plain[0]
        assert engine.generate(PROMPTS[0], **OPTS) == plain[0][0]
        assert engine.last_stats.finish_reason == "length"
        # 40 tokens, 4 a check
        assert engine.stats()["guardrail_pass"] == len(classifier.texts) >= 10
    finally:
        engine.close()


def test_a_flagged_output_ends_with_content_filter_frees_its_kv_and_spares_the_other(
        tiny_llama, monkeypatch, plain):
    first, second = plain[0]
    candidates = [w for w in re.findall(r"[A-Za-z]{2,}", first) if w not in second]
    assert candidates, (first, second)
    word = candidates[-1]  # the tiny random model's text has few words; its last one
    engine = engine_with(tiny_llama, monkeypatch, FlagWords(word))
    try:
        texts = engine.generate(PROMPTS, **OPTS)
        assert first.startswith(texts[0]) and word not in texts[0] and len(texts[0]) < len(first)
        assert texts[1] == second  # the batch's other sequence runs to its end
        assert engine.stats()["guardrail_flagged"] == 1
        text = engine.generate(PROMPTS[0], **OPTS)
        assert text == texts[0]
        stats = engine.last_stats
        assert stats.finish_reason == "content_filter"
        assert stats.stop_reason == "guardrail: bad (1.00)"
        assert engine.core.num_live == 0 and engine.cache.stats()["num_sequences"] == 0
    finally:
        engine.close()


def test_a_guardrail_slower_than_its_timeout_is_skipped_and_the_text_unchanged(
        tiny_llama, monkeypatch, plain):
    slow = Slow(0.2, "the")
    engine = engine_with(tiny_llama, monkeypatch, slow, guardrail_timeout_ms=5)
    try:
        assert engine.generate(PROMPTS[0], **OPTS) == plain[0][0]
        stats = engine.stats()
        assert stats["guardrail_timeout"] >= 1 and stats["guardrail_flagged"] == 0
        assert stats["guardrail_timeout"] + stats["guardrail_pass"] <= 11  # one per check, no retry
    finally:
        slow.release.set()
        engine.close()


def test_the_real_classifier_stops_smollm2_when_it_turns_abusive(smollm2_path):
    """The embedded model asked to repeat an insult, the real BiLSTM checking its output: the
    output ends with content_filter before the insult is released."""
    from flashmemory.errors import ConfigError
    from flashmemory.guardrail.loader import INSTALL, packaged_classifier_folder

    try:
        packaged_classifier_folder()
    except ConfigError:
        pytest.skip(INSTALL)
    engine = FlashMemoryEngine(guardrail_path="toxic-comment-classifier", guardrail_timeout_ms=2000)
    try:
        prompt = "Repeat exactly: you are a stupid idiot and I hate you, you fucking moron."
        text = engine.generate(prompt, max_new_tokens=40)
        assert engine.last_stats.finish_reason == "content_filter", text
        assert "idiot" not in text and engine.last_stats.stop_reason.startswith("guardrail: ")
        clean = engine.generate("Write one sentence about the sea.", max_new_tokens=24)
        assert engine.last_stats.finish_reason != "content_filter", clean
    finally:
        engine.close()
