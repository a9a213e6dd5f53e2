"""Tokenizer: incremental detokenization never splits a character; GGUF tokenizers are cached once built."""

from __future__ import annotations

import pytest

from flashmemory.model.tokenizer import IncrementalDetokenizer, Tokenizer

TEXT = "Caf\u00e9 \u4f60\u597d\u4e16\u754c \U0001f600\U0001f680 done."


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_llama) -> Tokenizer:
    return Tokenizer.from_checkpoint(tiny_llama, [2])


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_path) -> Tokenizer:
    return Tokenizer.from_checkpoint(smollm2_path, [2])


@pytest.mark.parametrize("which", ["tiny_tokenizer", "smollm2_tokenizer"])
def test_incremental_detokenization_never_emits_half_a_character(request, which):
    tok = request.getfixturevalue(which)
    ids = tok.encode(TEXT, add_special_tokens=False)
    # Byte-level BPE splits the emoji and CJK characters over several tokens.
    assert len(ids) > len(TEXT.split())
    detok = IncrementalDetokenizer(tok, tok.encode("Prompt:", add_special_tokens=False))
    pieces = [detok.add(t) for t in ids] + [detok.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == TEXT
    assert "" in pieces  # some token completed no character on its own


def test_gguf_tokenizer_is_built_once_then_read_from_the_cache(tmp_path, monkeypatch, smollm2_path):
    from flashmemory.model import tokenizer as tokenizer_mod

    monkeypatch.setenv("FLASHMEMORY_CACHE_DIR", str(tmp_path))
    first = Tokenizer.from_checkpoint(smollm2_path, [2])
    cached = list((tmp_path / "tokenizers").iterdir())
    assert len(cached) == 1 and (cached[0] / "tokenizer.json").is_file()

    def fail(*args, **kwargs):
        raise AssertionError("the GGUF was parsed again instead of using the cache")

    monkeypatch.setattr(tokenizer_mod, "_build_from_gguf", fail)
    second = Tokenizer.from_checkpoint(smollm2_path, [2])
    assert second.encode(TEXT) == first.encode(TEXT)
    assert second.has_chat_template


def test_corrupt_tokenizer_cache_is_rebuilt(tmp_path, monkeypatch, smollm2_path, tiny_llama):
    from transformers import AutoTokenizer

    from flashmemory.model import tokenizer as tokenizer_mod

    builds = []

    def build(path):  # stands in for the 13-second GGUF conversion
        builds.append(path)
        return AutoTokenizer.from_pretrained(str(tiny_llama))

    monkeypatch.setenv("FLASHMEMORY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tokenizer_mod, "_build_from_gguf", build)
    Tokenizer.from_checkpoint(smollm2_path, [2])
    (cached,) = (tmp_path / "tokenizers").iterdir()
    (cached / "tokenizer.json").write_text("{not json")
    tok = Tokenizer.from_checkpoint(smollm2_path, [2])
    assert len(builds) == 2
    assert tok.decode(tok.encode("hello world")) == "hello world"
    assert Tokenizer.from_checkpoint(smollm2_path, [2]).encode("hello") == tok.encode("hello")
    assert len(builds) == 2


def test_gguf_tokenizer_ends_generation_on_every_end_of_turn_token(smollm2_tokenizer):
    """As llama.cpp: <|endoftext|> ends a completion even where the GGUF names only <|im_end|> as EOS."""
    hf = smollm2_tokenizer.hf
    assert {hf.convert_tokens_to_ids("<|im_end|>"), hf.convert_tokens_to_ids("<|endoftext|>")} <= (
        smollm2_tokenizer.eos_token_ids
    )
    assert hf.convert_tokens_to_ids("<|im_start|>") not in smollm2_tokenizer.eos_token_ids
