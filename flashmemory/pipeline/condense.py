"""CondensePipeline: the seeds' hybrid deployment. A small model (the reader) reads a long document
a chunk at a time and copies the sentences that bear on the question; a large model (the answerer)
answers from those alone, so it prefills a few hundred tokens instead of the whole document.

The hand-off is token ids: the reader's copy is checked against the chunk it read (only spans it
repeats token for token survive, widened to whole sentences: `copied_spans.py`) and goes to the
answerer through a token bridge, without a trip through text. Every chunk's prompt starts with the
chunk, so a second question about the same document reuses the reader's prefix cache and reads
only the question.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from flashmemory.engine.engine import FlashMemoryEngine
from flashmemory.errors import ConfigError
from flashmemory.model.token_bridge import TokenBridge, bridges_between
from flashmemory.model.token_bytes import token_pieces
from flashmemory.model.tokenizer import Tokenizer
from flashmemory.pipeline.copied_spans import copied_spans, merge_spans, widen_to_sentences

INSTRUCTION = ("Copy, word for word, the sentences of the text above that help answer the "
               "question. If none does, write NONE.")
MIN_CHUNK_TOKENS = 64
_MARK = "\x00DOCUMENT\x00"


@dataclass(frozen=True)
class CondenseSettings:
    """How the reader condenses (units in the names: tokens are the reader's)."""

    chunk_tokens: int = 1024  # of the document per reader prompt
    overlap_tokens: int = 64  # each chunk repeats the end of the one before (a sentence cut there)
    extract_max_tokens: int = 64  # the reader's copy of one chunk, at most
    min_copy_tokens: int = 6  # a repeated span shorter than this is not a copy
    widen_tokens: int = 48  # how far a copied span grows to the ends of its sentences
    instruction: str = INSTRUCTION

    def __post_init__(self) -> None:
        if self.chunk_tokens < MIN_CHUNK_TOKENS:
            raise ConfigError(f"chunk_tokens={self.chunk_tokens}: a chunk needs at least "
                              f"{MIN_CHUNK_TOKENS} tokens; raise it")
        if not 0 <= self.overlap_tokens <= self.chunk_tokens // 2:
            raise ConfigError(f"overlap_tokens={self.overlap_tokens} must be 0 to half of "
                              f"chunk_tokens ({self.chunk_tokens // 2})")
        if self.extract_max_tokens < self.min_copy_tokens or self.min_copy_tokens < 2:
            raise ConfigError(f"min_copy_tokens={self.min_copy_tokens} must be at least 2 and at "
                              f"most extract_max_tokens={self.extract_max_tokens}")
        if self.widen_tokens < 0:
            raise ConfigError(f"widen_tokens={self.widen_tokens} must be 0 or more")


@dataclass
class Condensed:
    """What the reader kept of a document, in the answerer's ids, and what it cost."""

    ids: list[int]
    reader_spans: list[tuple[int, int]]  # [start, end) of `document_reader_ids` it kept
    document_reader_ids: list[int]  # the document as the reader read it
    num_chunks: int = 0
    reader_generated_tokens: int = 0
    seconds: float = 0.0
    outputs: list[list[int]] = field(default_factory=list)  # the reader's answer per chunk

    @property
    def kept_fraction(self) -> float:
        kept = sum(end - start for start, end in self.reader_spans)
        return kept / len(self.document_reader_ids) if self.document_reader_ids else 0.0


def template_parts(tokenizer: Tokenizer, before: str, after: str) -> tuple[list[int], list[int]]:
    """The ids of a one-message chat up to where a document goes and after it (the user's text
    `before` + document + `after`, then the assistant's turn)."""
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    if not tokenizer.has_chat_template:
        return enc(before), enc(after + "\n")
    full = tokenizer.chat_text([{"role": "user", "content": before + _MARK + after}])
    head, _, tail = full.partition(_MARK)
    return enc(head), enc(tail)


class CondensePipeline:
    """`reader` condenses, `answerer` answers; their vocabularies may differ."""

    def __init__(self, reader: FlashMemoryEngine, answerer: FlashMemoryEngine,
                 settings: CondenseSettings | None = None) -> None:
        self.reader = reader
        self.answerer = answerer
        self.settings = settings or CondenseSettings()
        pair = bridges_between(answerer.tokenizer, reader.tokenizer)
        self.to_reader, self.to_answerer = pair or (None, None)
        # the reader's bytes per id (for sentence ends): the bridge from it has read them already
        self._pieces = (self.to_answerer.pieces if self.to_answerer
                        else token_pieces(reader.tokenizer).pieces)
        self._separator = reader.tokenizer.encode("\n", add_special_tokens=False)

    def condense(self, document_ids: list[int], question: str) -> Condensed:
        """What the reader keeps of a document given in the answerer's ids."""
        return self._condense(_translate(self.to_reader, document_ids), question)

    def condense_text(self, document: str, question: str) -> Condensed:
        return self._condense(self.reader.tokenizer.encode(document, add_special_tokens=False),
                              question)

    def ask(self, document: str, question: str, **options: Any) -> tuple[str, Condensed]:
        """The answerer's answer to `question` from what the reader kept of `document`
        (`options`: generate_token_ids's), and what was kept."""
        condensed = self.condense_text(document, question)
        head, tail = template_parts(self.answerer.tokenizer, "", f"\n\nQuestion: {question}")
        ids = self.answerer.generate_token_ids(head + condensed.ids + tail, **options)
        return self.answerer.tokenizer.decode(ids), condensed

    def _condense(self, document: list[int], question: str) -> Condensed:
        started = time.perf_counter()
        s = self.settings
        head, tail = template_parts(self.reader.tokenizer, "",
                                    f"\n\nQuestion: {question}\n{s.instruction}")
        room = self.reader.max_seq_len - len(head) - len(tail) - s.extract_max_tokens
        chunk = min(s.chunk_tokens, room)
        if chunk < MIN_CHUNK_TOKENS:
            raise ConfigError(
                f"the reader reads at most {self.reader.max_seq_len} tokens: after the question "
                f"({len(head) + len(tail)} tokens) and its copy ({s.extract_max_tokens}) no chunk "
                f"of {MIN_CHUNK_TOKENS} fits; shorten the question or raise the reader's "
                "max_seq_len")
        out = Condensed([], [], document)
        spans: list[tuple[int, int]] = []
        step = chunk - min(s.overlap_tokens, chunk // 2)
        for start in range(0, max(1, len(document)), step):
            piece = document[start : start + chunk]
            copy = self.reader.generate_token_ids(head + piece + tail, temperature=0.0,
                                                  max_new_tokens=s.extract_max_tokens)
            out.outputs.append(copy)
            out.num_chunks += 1
            out.reader_generated_tokens += len(copy)
            spans += [(start + a, start + b) for a, b in copied_spans(copy, piece,
                                                                       s.min_copy_tokens)]
            if start + chunk >= len(document):
                break
        out.reader_spans = widen_to_sentences(merge_spans(spans), self._pieces, document,
                                              s.widen_tokens)
        kept: list[int] = []
        for a, b in out.reader_spans:
            kept += (self._separator if kept else []) + document[a:b]
        out.ids = _translate(self.to_answerer, kept)
        out.seconds = time.perf_counter() - started
        return out


def _translate(bridge: TokenBridge | None, ids: list[int]) -> list[int]:
    return bridge.translate(ids).ids if bridge is not None else list(ids)
