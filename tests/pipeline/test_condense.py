"""The condense-then-answer pipeline: the reader reads the whole document in chunks, what is kept
is the document's own text (never the reader's inventions), it crosses to the answerer's
vocabulary through the bridge, a second question reuses the reader's prefix cache; and with the
embedded SmolLM2 as the reader, a needle survives while the chunks without it add nothing."""

from __future__ import annotations

import math

import pytest

from flashmemory import FlashMemoryEngine
from flashmemory.errors import ConfigError
from flashmemory.pipeline import CondensePipeline, CondenseSettings
from tests.conftest import SHARED_DATA
from tests.helpers import CORPUS, write_tiny_model

TINY = CondenseSettings(chunk_tokens=96, overlap_tokens=16, extract_max_tokens=16,
                        min_copy_tokens=4, widen_tokens=8)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("condense")
    write_tiny_model(root / "reader", num_hidden_layers=1, seed=1, tokenizer_size=300,
                     tokenizer_corpus=CORPUS.upper() + CORPUS[:200])
    write_tiny_model(root / "answerer", num_hidden_layers=2, seed=2)
    return root


def _engine(path, tmp_path, name: str) -> FlashMemoryEngine:
    return FlashMemoryEngine(str(path), max_seq_len=256, cold_zone_dir=str(tmp_path / name))


def test_bad_settings_name_the_fix():
    with pytest.raises(ConfigError, match="at least 64"):
        CondenseSettings(chunk_tokens=8)
    with pytest.raises(ConfigError, match="half of chunk_tokens"):
        CondenseSettings(chunk_tokens=128, overlap_tokens=100)
    with pytest.raises(ConfigError, match="min_copy_tokens"):
        CondenseSettings(extract_max_tokens=4, min_copy_tokens=8)


def test_the_reader_reads_every_chunk_and_keeps_only_the_documents_text(models, tmp_path):
    reader = _engine(models / "reader", tmp_path, "r")
    answerer = _engine(models / "answerer", tmp_path, "a")
    pipeline = CondensePipeline(reader, answerer, TINY)
    assert pipeline.to_reader is not None  # two vocabularies: the hand-off crosses the bridge
    document = answerer.tokenizer.encode(CORPUS[:900], add_special_tokens=False)
    first = pipeline.condense(document, "What is the capital of France?")
    doc = first.document_reader_ids
    assert reader.tokenizer.decode(doc) == answerer.tokenizer.decode(document)  # nothing lost
    assert first.num_chunks == len(first.outputs) >= math.ceil(len(doc) / 96)
    for start, end in first.reader_spans:
        assert 0 <= start < end <= len(doc)
    kept = [doc[a:b] for a, b in first.reader_spans]
    sep = reader.tokenizer.encode("\n", add_special_tokens=False)
    joined = [t for i, span in enumerate(kept) for t in (sep if i else []) + span]
    assert answerer.tokenizer.decode(first.ids) == reader.tokenizer.decode(joined)
    hits = reader.stats()["prefix_cache_hits"]
    pipeline.condense(document, "Who was tired?")  # the same chunks: their KV is reused
    assert reader.stats()["prefix_cache_hits"] > hits
    reader.close(), answerer.close()


def test_a_chunk_that_leaves_no_room_is_refused_with_the_fix(models, tmp_path):
    reader = _engine(models / "reader", tmp_path, "r")
    answerer = _engine(models / "answerer", tmp_path, "a")
    pipeline = CondensePipeline(reader, answerer, CondenseSettings(extract_max_tokens=200))
    with pytest.raises(ConfigError, match="max_seq_len"):
        pipeline.condense([1, 2, 3], "What?")
    reader.close(), answerer.close()


def test_smollm2_keeps_the_needle_and_nothing_it_invented(smollm2_path, tiny_llama, tmp_path):
    reader = FlashMemoryEngine(str(smollm2_path), max_seq_len=1024, num_threads=1,
                               cold_zone_dir=str(tmp_path / "r"))
    answerer = _engine(tiny_llama, tmp_path, "a")
    text = (SHARED_DATA / "alice29.txt").read_text(encoding="utf-8")[20000:23000]
    needle = " The special magic number for quiet-harbor is 7291034."
    document = text[:1700] + needle + text[1700:]
    pipeline = CondensePipeline(reader, answerer,
                                CondenseSettings(chunk_tokens=256, extract_max_tokens=24))
    condensed = pipeline.condense_text(document,
                                       "What is the special magic number for quiet-harbor?")
    kept = answerer.tokenizer.decode(condensed.ids)
    assert condensed.num_chunks >= 3
    assert "quiet-harbor is 7291034" in kept
    assert condensed.kept_fraction < 0.1  # the chunks without the needle kept (next to) nothing
    reader.close(), answerer.close()
