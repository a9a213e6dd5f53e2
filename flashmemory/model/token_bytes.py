"""TokenPieces: what each id of a vocabulary stands for, as bytes (a byte-level BPE's GPT-2 alphabet
or a SentencePiece vocabulary's "▁" and <0xNN> byte pieces decoded), and its special (control)
tokens by name. Two vocabularies compare here: the same bytes are the same text, whatever the
ids."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from flashmemory.errors import ConfigError
from flashmemory.model.tokenizer import Tokenizer

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPACE_PIECE = "\u2581"  # SentencePiece's word-start mark


def _gpt2_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in for each byte (byte-level BPE vocabularies spell tokens in it)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
            *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in kept:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_GPT2 = _gpt2_alphabet()


@dataclass(frozen=True)
class TokenPieces:
    """Per id: its bytes (None: a control token, or an id the vocabulary leaves unnamed)."""

    pieces: list[bytes | None]
    special: dict[str, int]  # control tokens' names -> ids

    def __len__(self) -> int:
        return len(self.pieces)


def _tokenizer_json(tokenizer: Tokenizer) -> dict[str, Any]:
    backend = tokenizer.backend
    inner = getattr(backend, "backend", None) or getattr(backend, "backend_tokenizer", None)
    if inner is None:
        raise ConfigError(
            f"the tokenizer of {tokenizer.path} is not a fast (tokenizer.json) tokenizer, so its "
            "tokens' bytes are unknown; convert it with transformers (save_pretrained of its "
            "AutoTokenizer), or use speculative_method='ngram'")
    return json.loads(inner.to_str())


def _decoder_kinds(spec: dict[str, Any] | None) -> set[str]:
    if not spec:
        return set()
    if spec.get("type") == "Sequence":
        return {k for d in spec.get("decoders", []) for k in _decoder_kinds(d)}
    kinds = {spec.get("type", "")}
    if spec.get("type") == "Replace" and spec.get("pattern", {}).get("String") == _SPACE_PIECE:
        kinds.add("Metaspace")
    return kinds


def _byte_level(text: str) -> bytes | None:
    try:
        return bytes(_GPT2[c] for c in text)
    except KeyError:  # not spelled in the alphabet: not a piece the byte-level decoder decodes
        return None


def _sentencepiece(text: str) -> bytes:
    match = _BYTE_PIECE.fullmatch(text)
    if match:
        return bytes([int(match.group(1), 16)])
    return text.replace(_SPACE_PIECE, " ").encode()


def token_pieces(tokenizer: Tokenizer) -> TokenPieces:
    """Every id's bytes; a ConfigError naming the fix where the vocabulary's spelling is neither
    byte-level BPE nor SentencePiece."""
    spec = _tokenizer_json(tokenizer)
    kinds = _decoder_kinds(spec.get("decoder"))
    if "ByteLevel" in kinds:
        decode = _byte_level
    elif "Metaspace" in kinds or "ByteFallback" in kinds:
        decode = _sentencepiece
    else:
        raise ConfigError(
            f"the tokenizer of {tokenizer.path} spells its tokens with a decoder this bridge does "
            f"not read ({sorted(kinds) or 'none'}; byte-level BPE and SentencePiece are read); "
            "pick a draft with one of those, or use speculative_method='ngram'")
    added = {a["content"]: a for a in spec.get("added_tokens", [])}
    pieces: list[bytes | None] = [None] * tokenizer.vocab_size
    special: dict[str, int] = {}
    for text, token_id in tokenizer.vocabulary().items():
        if token_id >= len(pieces):
            pieces.extend([None] * (token_id + 1 - len(pieces)))
        info = added.get(text)
        if info is not None and info.get("id") == token_id:
            if info.get("special", True):
                special[text] = token_id
            else:  # an added text token (<tool_call>): its bytes as written
                pieces[token_id] = text.encode()
            continue
        pieces[token_id] = decode(text)
    return TokenPieces(pieces, special)
