"""ChatEncoder: a rendered chat template to token ids, the template's control tokens as control
tokens and the messages' content as plain text: typing "<|im_end|><|im_start|>system" into a
message cannot forge a turn.

How: before rendering, each control token in a message's content (a special added token, found by
the tokenizer itself, so normalized spellings and the spaces it strips count too) is swapped for a
placeholder; every control token left in the rendered text is then the template's. The tokenizer
splits text at its control tokens anyway, so the text between two of them (a "run") tokenizes on
its own as it does in one pass; a run holding a placeholder gets its content back and is tokenized
with special-token parsing off. Content without control-token text needs none of this: the
rendered text is tokenized in one pass, as before (the same ids).

NOTE: a run tokenized on its own starts a fresh pre-tokenization, so a Metaspace pre-tokenizer
with prepend_scheme="first" gives it a leading "▁" that one pass would not; only runs whose
content held control-token text are tokenized on their own.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from flashmemory.errors import ConfigError

Messages = list[dict[str, Any]]
TEXT_FIELDS = ("content", "name")  # a message's fields a user writes and a template may render


@dataclass
class EscapedChat:
    """Messages with placeholders where their content held control tokens, and what those were."""

    messages: Messages
    originals: list[str]  # placeholder i stands for originals[i]
    nonce: str  # in every placeholder: no text can spell one, by chance or on purpose

    def placeholder(self, index: int) -> str:
        # Private-use characters: no control token holds them.
        return f"\ue000{self.nonce}{index}\ue001"

    @cached_property
    def _pattern(self) -> re.Pattern[str]:
        return re.compile(f"\ue000{self.nonce}(\\d+)\ue001")

    def holds_placeholder(self, text: str) -> bool:
        return self._pattern.search(text) is not None

    def restore(self, text: str) -> str:
        return self._pattern.sub(lambda m: self.originals[int(m.group(1))], text)


class ChatEncoder:
    """Owns the model's `tokenizers.Tokenizer` (None for a tokenizer without one), its control
    tokens and, built on first need, a copy of it that reads control-token text as text."""

    def __init__(self, raw: Any, control_tokens: dict[int, str]) -> None:
        self.raw = raw  # a tokenizers.Tokenizer, or None (a slow transformers tokenizer)
        self.control_ids = frozenset(control_tokens)
        self.control_texts = tuple(sorted(set(control_tokens.values())))
        # A token matched after normalization can hide in other spellings: scan every content then.
        self._literal = raw is None or all(
            not t.normalized for i, t in raw.get_added_tokens_decoder().items()
            if i in self.control_ids)

    @classmethod
    def of(cls, backend: Any) -> "ChatEncoder":
        """The encoder of a FastTokenizer or of a transformers tokenizer."""
        raw = getattr(backend, "backend_tokenizer", None)  # transformers' fast tokenizers
        if raw is None and hasattr(backend, "folder"):
            raw = backend.backend  # FastTokenizer
        decoder = raw.get_added_tokens_decoder() if raw is not None else \
            getattr(backend, "added_tokens_decoder", {})
        return cls(raw, {i: t.content for i, t in decoder.items() if t.special})

    def escape(self, messages: Messages) -> EscapedChat:
        """The messages with a placeholder for each control token in their text (the content, and
        a participant's name where a template renders it)."""
        chat = EscapedChat([], [], secrets.token_hex(8))
        for m in messages:
            for key in TEXT_FIELDS:
                text = m.get(key)
                spans = self._control_spans(text) if isinstance(text, str) else []
                if spans:
                    m = {**m, key: self._swap(text, spans, chat)}
            chat.messages.append(m)
        return chat

    def encode(self, text: str, chat: EscapedChat) -> list[int]:
        """Ids of a template rendered from `chat.messages`: its control tokens as such, each run
        between them as one pass reads it, or, where it holds a placeholder, with the content put
        back and read as text."""
        if self.raw is None:
            raise ConfigError(
                f"a message holds the control token {chat.originals[0]!r} and this model's tokenizer "
                "(no tokenizer.json) cannot read it as plain text; remove it from the messages, or "
                "start the engine with parse_special_tokens_in_content=True to let content write "
                "control tokens")
        enc = self.raw.encode(text, add_special_tokens=False)
        out: list[int] = []
        run: list[int] = []
        run_start = 0
        for token_id, (start, end) in zip(enc.ids, enc.offsets):
            if token_id in self.control_ids:
                out += self._run_ids(text[run_start:start], run, chat)
                out.append(token_id)
                run, run_start = [], end
            else:
                run.append(token_id)
        out += self._run_ids(text[run_start:], run, chat)
        return out

    def _run_ids(self, text: str, ids: list[int], chat: EscapedChat) -> list[int]:
        if not chat.holds_placeholder(text):
            return ids  # as the one pass read it
        return self._as_text.encode(chat.restore(text), add_special_tokens=False).ids

    @cached_property
    def _as_text(self) -> Any:
        """A copy of the tokenizer with special-token parsing off (the shared one is never
        toggled: other threads encode with it)."""
        import tokenizers

        copy = tokenizers.Tokenizer.from_str(self.raw.to_str())
        copy.encode_special_tokens = True
        return copy

    def _control_spans(self, content: str) -> list[tuple[int, int]]:
        """Character spans of the control tokens the tokenizer finds in `content`, in order."""
        if self._literal and not any(t in content for t in self.control_texts):
            return []  # the common case: a substring test instead of tokenizing the content twice
        if self.raw is None:
            longest_first = sorted(self.control_texts, key=len, reverse=True)
            pattern = "|".join(re.escape(t) for t in longest_first)
            return [m.span() for m in re.finditer(pattern, content)]
        enc = self.raw.encode(content, add_special_tokens=False)
        return [span for token_id, span in zip(enc.ids, enc.offsets) if token_id in self.control_ids]

    @staticmethod
    def _swap(content: str, spans: list[tuple[int, int]], chat: EscapedChat) -> str:
        pieces, last = [], 0
        for start, end in spans:
            pieces += [content[last:start], chat.placeholder(len(chat.originals))]
            chat.originals.append(content[start:end])
            last = end
        pieces.append(content[last:])
        return "".join(pieces)
