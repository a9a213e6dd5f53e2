"""TokenBridge: token ids of one vocabulary as ids of another, without a trip through text for the
tokens both spell the same.

A table built once per pair (cached on disk under the two tokenizers' fingerprints) maps each
source id to the destination id with the same bytes, control tokens by name. Translation goes word
by word: a one-token word the table maps crosses as one id, any other word is re-read by the
destination's tokenizer (so the result is that tokenizer's own reading of the text). Bytes that end
inside a UTF-8 character wait for the tokens that finish it; bytes that are no UTF-8 cross as
one-byte tokens. A word's translation depends on that word alone, so the translation of a sequence
grows with it (`BridgeStream`): what a finished word translated to never changes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flashmemory.model.token_bytes import TokenPieces, token_pieces
from flashmemory.model.tokenizer import Tokenizer, cache_root

logger = logging.getLogger(__name__)
UNMAPPED = -1
TABLE_FOLDER = "bridges"


def pieces_fingerprint(pieces: TokenPieces) -> str:
    """A short hash of what every id stands for."""
    h = hashlib.sha256()
    for piece in pieces.pieces:
        h.update(b"\x00" if piece is None else b"\x01" + len(piece).to_bytes(2, "little") + piece)
    for name, token_id in sorted(pieces.special.items()):
        h.update(name.encode() + b"\x02" + token_id.to_bytes(4, "little"))
    return h.hexdigest()[:16]


def build_table(source: TokenPieces, dest: TokenPieces) -> np.ndarray:
    """Per source id, the destination id of the same bytes or control name (the lowest where the
    destination spells it twice), UNMAPPED where there is none."""
    by_bytes: dict[bytes, int] = {}
    for token_id, piece in enumerate(dest.pieces):
        if piece is not None:
            by_bytes.setdefault(piece, token_id)
    table = np.full(len(source), UNMAPPED, dtype=np.int32)
    for token_id, piece in enumerate(source.pieces):
        if piece is not None:
            table[token_id] = by_bytes.get(piece, UNMAPPED)
    for name, token_id in source.special.items():
        table[token_id] = dest.special.get(name, UNMAPPED)
    return table


def _complete(data: bytes) -> int:
    """Length of the longest prefix of `data` that does not end inside a UTF-8 character."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # a lead (or ASCII) byte: does its character end in `data`?
            width = 1 if byte < 0x80 else 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 \
                else 4 if byte >> 3 == 0b11110 else 1
            return len(data) if back >= width else len(data) - back
    return len(data)


def _broken(data: bytes) -> bool:
    """Whether `data` holds bytes that are no UTF-8 (an unfinished last character is not)."""
    try:
        data[: _complete(data)].decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


_SPACE = frozenset(b" \t\r\n\x0b\x0c")
# A word of more source tokens than this is translated in parts (it stays provisional until done).
MAX_RUN_TOKENS = 16


def _wordlike(byte: int) -> bool:
    return byte >= 0x80 or chr(byte).isalnum()


def _continues(run: bytes, piece: bytes) -> bool:
    """Whether `piece` goes on the word `run` ends with, as byte-level pre-tokenizers split text:
    letters, digits and other scripts' bytes go on anything; white space belongs to what follows
    it; signs and line breaks go on signs. Joining more than the destination's own pre-tokenizer
    would only delay a word's translation; it never changes it."""
    if not run or not piece:
        return bool(run)
    if _broken(run):
        return False  # no byte can mend it: the word is over
    first, last = piece[0], run[-1]
    if _wordlike(first) or last in _SPACE:
        return True
    if first in _SPACE and first not in b"\r\n":
        return False
    return not _wordlike(last)


class TokenBridge:
    """Translates ids of `source`'s vocabulary into ids of `dest`'s."""

    def __init__(self, dest: Tokenizer, table: np.ndarray, pieces: TokenPieces,
                 dest_pieces: TokenPieces) -> None:
        self.dest = dest
        self.table = table.tolist()
        self.pieces = pieces.pieces  # the source's
        self.dest_bytes = {p[0]: i for i, p in reversed(list(enumerate(dest_pieces.pieces)))
                           if p is not None and len(p) == 1}  # byte -> the destination's token
        self.mapped_share = float((table != UNMAPPED).mean()) if len(table) else 0.0

    @classmethod
    def between(cls, source: Tokenizer, dest: Tokenizer,
                cache_dir: Path | None = None) -> "TokenBridge":
        """The bridge from `source` to `dest`, its table read from the cache when built before."""
        return cls._of(dest, token_pieces(source), token_pieces(dest), cache_dir)

    @classmethod
    def _of(cls, dest: Tokenizer, src: TokenPieces, dst: TokenPieces,
            cache_dir: Path | None) -> "TokenBridge":
        folder = (cache_dir or cache_root()) / TABLE_FOLDER
        path = folder / f"{pieces_fingerprint(src)}-{pieces_fingerprint(dst)}.npy"
        table = _load(path, len(src))
        if table is None:
            table = build_table(src, dst)
            _save(path, table)
        return cls(dest, table, src, dst)

    def piece(self, token_id: int) -> bytes | None:
        return self.pieces[token_id] if 0 <= token_id < len(self.pieces) else None

    def mapped(self, token_id: int) -> int:
        return self.table[token_id] if 0 <= token_id < len(self.table) else UNMAPPED

    def word(self, run: list[int], data: bytes, finished: bool = False) -> list[int]:
        """One word's destination ids: the table's where it is one token the table maps, the
        destination tokenizer's reading of its text otherwise (up to a character it leaves
        unfinished, unless the word is `finished`)."""
        if len(run) == 1 and (mapped := self.mapped(run[0])) != UNMAPPED:
            return [mapped]
        return self.encode(data if finished else data[: _complete(data)])

    def encode(self, data: bytes) -> list[int]:
        """`data` in destination ids: its text through the destination's tokenizer, bytes that
        are no UTF-8 as the destination's one-byte tokens (U+FFFD where it has none)."""
        out: list[int] = []
        while data:
            try:
                text, bad, rest = data.decode("utf-8"), b"", b""
            except UnicodeDecodeError as e:
                text, bad, rest = data[: e.start].decode("utf-8"), data[e.start : e.end], \
                    data[e.end :]
            if text:
                out.extend(self.dest.encode(text, add_special_tokens=False))
            for byte in bad:
                single = self.dest_bytes.get(byte)
                out.extend([single] if single is not None else
                           self.dest.encode("\ufffd", add_special_tokens=False))
            data = rest
        return out

    def translate(self, ids: list[int], stop_at_unnamed: bool = False) -> "Translation":
        """All of `ids` (the last word closed too) as destination ids. A source control token the
        destination lacks, or an id that names nothing, is skipped, or with `stop_at_unnamed`
        ends the translation there."""
        stream = BridgeStream(self, stop_at_unnamed)
        stream.extend(ids)
        stream.close_word()
        return Translation(stream.committed, stream.source_len, stream.stopped)


def bridges_between(a: Tokenizer, b: Tokenizer, cache_dir: Path | None = None
                    ) -> tuple[TokenBridge, TokenBridge] | None:
    """The bridges a -> b and b -> a (each vocabulary's bytes read once), or None where the two
    are one vocabulary (the same ids for the same texts) and ids need no translating."""
    if a.vocabulary() == b.vocabulary():
        return None
    pa, pb = token_pieces(a), token_pieces(b)
    return TokenBridge._of(b, pa, pb, cache_dir), TokenBridge._of(a, pb, pa, cache_dir)


@dataclass
class Translation:
    """Destination ids; how many source tokens they translate (fewer than given when an
    untranslatable one stopped it)."""

    ids: list[int]
    consumed: int
    stopped: bool = False


class BridgeStream:
    """A growing sequence of source ids and its translation, word by word. `committed`: the
    translation of the finished words, which never changes; `tail`: that of the word still open
    (the next source token may go on it). Without a bridge (the same vocabulary) the ids are
    their own translation."""

    def __init__(self, bridge: TokenBridge | None, stop_at_unnamed: bool = False) -> None:
        self.bridge = bridge
        self.stop_at_unnamed = stop_at_unnamed
        self.source_len = 0  # source tokens read
        self.committed: list[int] = []
        self.tail: list[int] = []
        self.stopped = False
        self._run: list[int] = []  # the open word's source ids and bytes
        self._bytes = b""

    def extend(self, source_ids: list[int]) -> None:
        bridge = self.bridge
        if bridge is None:
            self.committed.extend(source_ids)
            self.source_len += len(source_ids)
            return
        for token_id in source_ids:
            if self.stopped:
                return
            piece = bridge.piece(token_id)
            if piece is None:  # a control token, or an id that names nothing
                self.close_word()
                mapped = bridge.mapped(token_id)
                if mapped != UNMAPPED:
                    self.committed.append(mapped)
                elif self.stop_at_unnamed:
                    self.stopped = True
                    return
            else:
                # No character is longer than 4 bytes: past them, what is open is no text.
                done = _complete(self._bytes) == len(self._bytes)
                full = len(self._run) >= MAX_RUN_TOKENS + (0 if done else 3)
                if full or not _continues(self._bytes, piece):
                    self.close_word()
                self._run.append(token_id)
                self._bytes += piece
            self.source_len += 1
        self.tail = bridge.word(self._run, self._bytes) if self._run else []

    def close_word(self) -> None:
        """The open word is finished: its translation is committed (a character it leaves
        unfinished as the decoder shows one)."""
        if self._run and self.bridge is not None:
            self.committed.extend(self.bridge.word(self._run, self._bytes, finished=True))
        self._run, self._bytes, self.tail = [], b"", []

    @property
    def ids(self) -> list[int]:
        """Everything read so far, the open word as it reads now."""
        return self.committed + self.tail


def _load(path: Path, size: int) -> np.ndarray | None:
    try:
        table = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        logger.warning("the token bridge table %s is unreadable (%s); building it again", path, e)
        return None
    if table.dtype != np.int32 or table.shape != (size,):
        logger.warning("the token bridge table %s does not fit its vocabulary; building it again",
                       path)
        return None
    return table


def _save(path: Path, table: np.ndarray) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, staging = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".npy")
        with os.fdopen(fd, "wb") as f:
            np.save(f, table, allow_pickle=False)
        os.replace(staging, path)  # atomic: a reader sees the whole table or none
    except OSError as e:
        logger.warning("could not cache the token bridge table in %s: %s", path, e)
