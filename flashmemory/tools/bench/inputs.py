"""What every engine of one benchmark shares: the weights (a safetensors folder, and the GGUF for llama.cpp), the
model's facts, and the token ids of the text, tokenized once so every engine reads the same prompt."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from flashmemory.errors import ConfigError, FlashMemoryError
from flashmemory.model.model_config import ModelConfig

logger = logging.getLogger(__name__)


@dataclass
class BenchInputs:
    """The model and the text every engine is given."""

    folder: Path  # HF safetensors folder: FlashMemory and transformers load the same dequantized weights from it
    gguf_path: Path | None  # the original GGUF (llama.cpp), None when the model given is a folder
    model_config: ModelConfig
    text_path: Path
    token_ids: list[int]  # the whole text, tokenized without special tokens

    @property
    def max_context_tokens(self) -> int:
        return self.model_config.max_context_tokens

    def fp16_kv_bytes(self, num_tokens: int) -> int:
        """Bytes of an FP16 K/V cache of num_tokens tokens for this model (the exact reference layout)."""
        return num_tokens * self.model_config.kv_bytes_per_token(2)

    def prompt_tokens(self, length_tokens: int, decode_tokens: int) -> int:
        """Prompt length for a requested context: capped so prompt + decoded tokens stay below the model's limit."""
        return max(1, min(length_tokens, self.max_context_tokens - decode_tokens - 1))

    def write_token_ids(self, path: Path) -> Path:
        path.write_text(json.dumps(self.token_ids))
        return path


def export_folder(model_path: str | None) -> tuple[Path, Path | None]:
    """(safetensors folder, GGUF or None): a GGUF is dequantized once into the cache; a folder is used as is."""
    from flashmemory.model.loader import open_checkpoint, resolve_model_path
    from flashmemory.model.tokenizer import cache_root, file_fingerprint

    path = resolve_model_path(model_path)
    if path.is_dir() and (path / "config.json").is_file():
        return path, None
    checkpoint = open_checkpoint(path)
    gguf = checkpoint.path
    out = cache_root() / "hf-export" / file_fingerprint(gguf)
    if not (out / "config.json").is_file():
        from flashmemory.model.export import export_safetensors

        logger.warning("exporting %s to %s (once)", gguf.name, out)
        export_safetensors(checkpoint, out)
    return out, gguf


def load_inputs(model_path: str | None, text_path: Path | None) -> BenchInputs:
    """Resolve the model and the text; tokenize the text with the model's tokenizer."""
    from flashmemory.model.loader import open_checkpoint
    from flashmemory.tools.eval import default_text_path

    text = text_path if text_path is not None else default_text_path()
    if text is None:
        raise ConfigError("no --text given and ../shared/data/alice29.txt not found: pass a long text file")
    try:
        body = Path(text).read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise FlashMemoryError(f"cannot read --text {str(text)!r}: {e.strerror}") from e
    folder, gguf = export_folder(model_path)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    ids = tokenizer.encode(body, add_special_tokens=False)
    return BenchInputs(folder, gguf, open_checkpoint(folder).config, Path(text), ids)
