"""The token bridge between two vocabularies: tokens' bytes, the table (built once, cached, rebuilt
when unreadable), word-by-word translation that reads as the destination's own tokenizer does,
never loses a byte, and grows with its sequence without changing what it translated."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from flashmemory.errors import ConfigError
from flashmemory.model import token_bridge
from flashmemory.model.token_bridge import UNMAPPED, BridgeStream, TokenBridge
from flashmemory.model.token_bytes import token_pieces
from flashmemory.model.tokenizer import Tokenizer
from tests.helpers import CORPUS, SPECIAL_TOKENS, write_tiny_tokenizer

# Text neither tokenizer was trained on: other words, accents, CJK and emoji split into bytes,
# line breaks after signs, indentation.
HELD_OUT = ("Grace Hopper's compiler (1952) ran; naïve façade? 東京タワー 🚀🛰️ done.\n\n"
            "def f(x):\n    return {'k': x}  # ok\n")


def _tokenizer(folder, size: int, corpus: str = CORPUS) -> Tokenizer:
    write_tiny_tokenizer(folder, size, corpus)
    return Tokenizer.from_checkpoint(folder, [])


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Two byte-level vocabularies trained on different text: other tokens, other ids."""
    root = tmp_path_factory.mktemp("bridge")
    a = _tokenizer(root / "a", 320)
    b = _tokenizer(root / "b", 420, CORPUS.upper() + " ".join(reversed(CORPUS.split()[:20])))
    return a, b


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHMEMORY_CACHE_DIR", str(tmp_path / "cache"))


def test_each_tokens_bytes_are_what_the_tokenizer_decodes_it_to(pair):
    tok = pair[0]
    pieces = token_pieces(tok)
    assert sorted(pieces.special) == sorted(SPECIAL_TOKENS)
    assert all(pieces.pieces[i] is None for i in pieces.special.values())
    for token_id, piece in enumerate(pieces.pieces):
        if piece is not None:
            text = tok.backend.decode([token_id], skip_special_tokens=False)
            assert piece.decode("utf-8", errors="replace") == text
    assert len({p for p in pieces.pieces if p is not None and len(p) == 1}) == 256


def test_the_table_maps_the_same_bytes_and_control_names_whatever_the_ids(pair):
    a, b = pair
    pa, pb = token_pieces(a), token_pieces(b)
    table = token_bridge.build_table(pa, pb)
    for token_id, mapped in enumerate(table.tolist()):
        if mapped != UNMAPPED and pa.pieces[token_id] is not None:
            assert pb.pieces[mapped] == pa.pieces[token_id]
    for name, token_id in pa.special.items():
        assert table[token_id] == pb.special[name]
    unmapped = [i for i, m in enumerate(table.tolist()) if m == UNMAPPED]
    assert unmapped and all(pa.pieces[i] not in set(pb.pieces) for i in unmapped)


@pytest.mark.parametrize("text", [CORPUS[:300], HELD_OUT])
def test_a_translation_reads_as_the_destinations_own_tokenizer_and_loses_no_byte(pair, text):
    for source, dest in (pair, pair[::-1]):
        bridge = TokenBridge.between(source, dest)
        ids = source.encode(text, add_special_tokens=False)
        out = bridge.translate(ids).ids
        assert dest.backend.decode(out, skip_special_tokens=False) == text
        assert out == dest.encode(text, add_special_tokens=False)


def test_the_stream_grows_token_by_token_and_never_changes_what_it_translated(pair):
    a, b = pair
    bridge = TokenBridge.between(a, b)
    ids = a.apply_chat_template([{"role": "user", "content": HELD_OUT}])
    stream = BridgeStream(bridge)
    committed: list[int] = []
    for n, token_id in enumerate(ids):
        stream.extend([token_id])
        assert stream.committed[: len(committed)] == committed  # nothing it gave changed
        committed = list(stream.committed)
        whole = bridge.translate(ids[: n + 1]).ids  # the open word read as finished
        assert whole[: len(stream.ids)] == stream.ids  # less only a character not finished yet
        assert len(whole) - len(stream.ids) <= 3
    assert stream.source_len == len(ids)


def test_bytes_split_across_tokens_wait_for_their_character(pair):
    a, b = pair
    bridge = TokenBridge.between(a, b)
    emoji = "🚀".encode()
    by_byte = {p: i for i, p in enumerate(token_pieces(a).pieces) if p is not None}
    ids = [by_byte[emoji[k : k + 1]] for k in range(4)]
    stream = BridgeStream(bridge)
    stream.extend(ids[:3])
    assert stream.ids == []  # an unfinished character translates to nothing yet
    stream.extend(ids[3:])
    assert b.backend.decode(stream.ids) == "🚀"


def test_bytes_that_are_no_text_cross_as_single_bytes(pair):
    a, b = pair
    bridge = TokenBridge.between(a, b)
    by_byte = {p: i for i, p in enumerate(token_pieces(a).pieces) if p is not None}
    garbage = [by_byte[bytes([x])] for x in (0xFF, 0x80, 0x41, 0xC3)]  # no UTF-8, then "A", a lead
    out = bridge.translate(garbage).ids
    dest = token_pieces(b).pieces
    assert b"".join(dest[i] for i in out) == b"\xff\x80A\xc3"


def test_a_control_token_the_destination_lacks_is_skipped_or_stops_a_proposal(pair, tmp_path):
    a, _ = pair
    spec = json.loads((a.backend.folder / "tokenizer.json").read_text())
    for added in spec["added_tokens"]:
        if added["content"] == "<|im_end|>":
            added["content"] = "<|end|>"
    spec["model"]["vocab"]["<|end|>"] = spec["model"]["vocab"].pop("<|im_end|>")
    other = tmp_path / "other"
    other.mkdir()
    for path in a.backend.folder.glob("*.json"):
        (other / path.name).write_text(path.read_text().replace("<|im_end|>", "<|end|>"))
    (other / "tokenizer.json").write_text(json.dumps(spec))
    b = Tokenizer.from_checkpoint(other, [])
    bridge = TokenBridge.between(a, b)
    end = a.vocabulary()["<|im_end|>"]
    ids = a.encode("Paris", add_special_tokens=False)
    assert bridge.translate([*ids, end, *ids]).ids == b.encode("ParisParis",
                                                                add_special_tokens=False)
    stopped = bridge.translate([*ids, end, *ids], stop_at_unnamed=True)
    assert stopped.stopped and stopped.consumed == len(ids)
    assert stopped.ids == b.encode("Paris", add_special_tokens=False)


def test_the_table_is_built_once_and_rebuilt_when_unreadable(pair, tmp_path, monkeypatch, caplog):
    a, b = pair
    first = TokenBridge.between(a, b)
    (path,) = (tmp_path / "cache" / token_bridge.TABLE_FOLDER).glob("*.npy")
    monkeypatch.setattr(token_bridge, "build_table", lambda *_: pytest.fail("built again"))
    assert TokenBridge.between(a, b).table == first.table
    monkeypatch.undo()
    monkeypatch.setenv("FLASHMEMORY_CACHE_DIR", str(tmp_path / "cache"))
    path.write_bytes(b"not a table")
    with caplog.at_level(logging.WARNING):
        assert TokenBridge.between(a, b).table == first.table
    assert "unreadable" in caplog.text
    np.save(path, np.zeros(3, dtype=np.int32))
    assert TokenBridge.between(a, b).table == first.table  # another vocabulary's size: rebuilt


def test_a_tokenizer_whose_bytes_are_unknown_is_refused_with_the_fix(pair, monkeypatch):
    from flashmemory.model import token_bytes

    monkeypatch.setattr(token_bytes, "_tokenizer_json",
                        lambda _: {"decoder": {"type": "WordPiece"}, "added_tokens": []})
    with pytest.raises(ConfigError, match="speculative_method='ngram'"):
        token_pieces(pair[0])


def test_sentencepiece_pieces_read_their_word_marks_and_byte_pieces(tmp_path):
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "▁Paris": 2, "▁is": 3, "<0xE6>": 4, "<0x9D>": 5, "<0xB1>": 6}
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    raw.pre_tokenizer = pre_tokenizers.Split("▁", "merged_with_next")
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>",
                            bos_token="<s>").save_pretrained(str(tmp_path))
    pieces = token_pieces(Tokenizer.from_checkpoint(tmp_path, []))
    assert pieces.pieces[2:] == [b" Paris", b" is", b"\xe6", b"\x9d", b"\xb1"]
    assert pieces.special == {"<unk>": 0, "<s>": 1}


def test_the_pair_of_bridges_is_both_directions_and_none_for_one_vocabulary(pair):
    a, b = pair
    there, back = token_bridge.bridges_between(a, b)
    assert there.table == TokenBridge.between(a, b).table
    assert back.table == TokenBridge.between(b, a).table
    assert token_bridge.bridges_between(a, a) is None
