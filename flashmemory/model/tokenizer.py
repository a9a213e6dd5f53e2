"""Tokenizer and chat template for safetensors folders and GGUF files alike: read with `tokenizers` and jinja2
(fast_tokenizer.py) where the folder has a tokenizer.json, through transformers otherwise (and to convert a GGUF's
vocabulary once into such a folder)."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from functools import cached_property
from pathlib import Path
from typing import Any

from flashmemory.errors import ConfigError, ModelNotFoundError
from flashmemory.model.chat_tokens import ChatEncoder
from flashmemory.model.fast_tokenizer import FastTokenizer, TemplateUnsupported

logger = logging.getLogger(__name__)

_FINGERPRINT_BYTES = 16 * 1024 * 1024  # GGUF metadata (the whole tokenizer) lives at the start of the file
# Special tokens that end generation whatever the GGUF names as EOS: llama.cpp's list (llama-vocab.cpp,
# special_eog_ids). Qwen2.5's GGUF states only <|im_end|>, yet a plain completion ends with <|endoftext|>.
END_OF_GENERATION_TOKENS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>",
    "<|end_of_text|>",
)


def cache_root() -> Path:
    """Where derived artefacts (converted tokenizers) are kept: $FLASHMEMORY_CACHE_DIR or ~/.cache/flashmemory."""
    env = os.environ.get("FLASHMEMORY_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "flashmemory"


def file_fingerprint(path: Path) -> str:
    """A short hash of a file's size and leading bytes; changes when a GGUF's metadata changes."""
    h = hashlib.sha256(str(path.stat().st_size).encode())
    with path.open("rb") as f:
        h.update(f.read(_FINGERPRINT_BYTES))
    return h.hexdigest()[:16]


def _build_from_gguf(gguf_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def _load_folder(folder: Path):
    """The folder's tokenizer: the lean reader where it has a tokenizer.json, transformers' otherwise."""
    if FastTokenizer.supports(folder):
        return FastTokenizer(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def _load_gguf_tokenizer(gguf_path: Path):
    # Building a tokenizer from GGUF metadata takes seconds; keep the converted copy keyed by the file's fingerprint.
    cached = cache_root() / "tokenizers" / file_fingerprint(gguf_path)
    if (cached / "tokenizer_config.json").is_file():
        try:
            return _load_folder(cached)
        except Exception as e:  # noqa: BLE001 - any failure of a cached copy means: rebuild it
            logger.warning("cached tokenizer at %s is unusable (%s); rebuilding it", cached, e)
            shutil.rmtree(cached, ignore_errors=True)
    logger.info("building the tokenizer from %s (once; cached in %s)", gguf_path.name, cached)
    tok = _build_from_gguf(gguf_path)
    staging: Path | None = None
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=cached.parent, prefix=".tmp-"))
        tok.save_pretrained(str(staging))
        os.replace(staging, cached)  # atomic: a reader sees the whole folder or none
    except OSError as e:
        logger.warning("could not cache the tokenizer in %s: %s", cached, e)
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        return tok
    return _load_folder(cached)  # the same reader as every later start, from the first one on


def end_of_generation_ids(backend: Any) -> list[int]:
    """Ids of the special (added) tokens in END_OF_GENERATION_TOKENS that this vocabulary has."""
    added = backend.get_added_vocab()  # {text: id}; ordinary BPE pieces never match
    return [added[text] for text in END_OF_GENERATION_TOKENS if text in added]


class Tokenizer:
    """Owns the model's tokenizer (the lean reader or transformers'): encode, decode, chat template, end ids."""

    def __init__(self, backend: Any, eos_token_ids: list[int], path: Path | None = None,
                 parse_special_tokens_in_content: bool = False) -> None:
        self.backend = backend
        self.path = path  # the checkpoint, for a transformers tokenizer made on demand (`hf`)
        ids = set(eos_token_ids)
        if backend.eos_token_id is not None:
            ids.add(int(backend.eos_token_id))
        self.eos_token_ids = frozenset(ids)
        # False: control-token text in a chat message is text (chat_tokens.py); True: the
        # rendered template is tokenized in one pass, so a message can write control tokens.
        self.parse_special_tokens_in_content = parse_special_tokens_in_content

    @classmethod
    def from_checkpoint(cls, path: Path, eos_token_ids: list[int],
                        parse_special_tokens_in_content: bool = False) -> "Tokenizer":
        if path.is_file():
            backend = _load_gguf_tokenizer(path)
            return cls(backend, [*eos_token_ids, *end_of_generation_ids(backend)], path,
                       parse_special_tokens_in_content)
        try:
            return cls(_load_folder(path), eos_token_ids, path, parse_special_tokens_in_content)
        except (OSError, ValueError) as e:
            raise ModelNotFoundError(
                f"{path} has no usable tokenizer ({e}); the folder needs tokenizer.json or tokenizer.model "
                "with tokenizer_config.json"
            ) from e

    @cached_property
    def hf(self) -> Any:
        """The same tokenizer as transformers' object (loaded on first use: exporting a checkpoint, a chat
        template the lean reader cannot render)."""
        if not isinstance(self.backend, FastTokenizer):
            return self.backend
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.backend.folder))

    @cached_property
    def chat_encoder(self) -> ChatEncoder:
        return ChatEncoder.of(self.backend)

    @property
    def vocab_size(self) -> int:
        return len(self.backend)

    def vocabulary(self) -> dict[str, int]:
        """Every token's text (as the vocabulary spells it) and id, added tokens included."""
        return dict(self.backend.get_vocab())

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.backend, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int]) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=True)

    def chat_text(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The chat template rendered to text (transformers renders it where the lean reader cannot)."""
        try:
            return self.backend.apply_chat_template(messages, tokenize=False,
                                                    add_generation_prompt=add_generation_prompt)
        except TemplateUnsupported:
            return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Ids of the rendered chat template; control-token text in a message's content stays
        text unless parse_special_tokens_in_content is set."""
        if not self.has_chat_template:
            raise ConfigError("this model's tokenizer has no chat template; send a plain prompt instead of messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ConfigError(f"message {i} must be a dict with 'role' and 'content', got {m!r}")
        if self.parse_special_tokens_in_content:
            return self._encode_rendered(self.chat_text(messages, add_generation_prompt))
        chat = self.chat_encoder.escape(messages)
        text = self.chat_text(chat.messages, add_generation_prompt)
        if not chat.originals:
            return self._encode_rendered(text)  # no control-token text in any content: one pass
        return self.chat_encoder.encode(text, chat)

    def _encode_rendered(self, text: str) -> list[int]:
        # The template already wrote any BOS it wants: don't add special tokens twice.
        return self.encode(text, add_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text pieces, never emitting half of a multi-byte character."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None) -> None:
        self.tokenizer = tokenizer
        # A few prompt tokens give the decoder left context (leading-space handling of SentencePiece tokenizers).
        context = list(prompt_ids[-4:]) if prompt_ids else []
        self.ids: list[int] = context
        self.prefix_offset = 0
        self.read_offset = len(context)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (possibly empty)."""
        self.ids.append(token_id)
        prefix_text = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Text of trailing tokens still held back (an incomplete character at the very end stays as U+FFFD)."""
        prefix_text = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self.tokenizer.decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full_text[len(prefix_text) :]
