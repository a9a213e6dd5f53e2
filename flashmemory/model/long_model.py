"""Locate the optional long-context model: Qwen2.5-Coder-0.5B-Instruct (GGUF, 32,768 positions), which
../shared/models/fetch-qwen2.5-coder-0.5b.sh assembles; tests and tools that need 32K contexts find it here."""

from __future__ import annotations

import os
from pathlib import Path

from flashmemory.errors import ModelNotFoundError

LONG_MODEL_ENV = "FLASHMEMORY_LONG_MODEL"  # a path to the GGUF, overriding the default location
LONG_MODEL_FILE = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
FETCH_COMMAND = "bash ../shared/models/fetch-qwen2.5-coder-0.5b.sh"  # from the repository root; ~480 MB, once


def default_long_model_path() -> Path:
    """Where the fetch script puts the file: $FLASHMEMORY_MODELS_DIR or ~/.cache/flashmemory/models."""
    folder = os.environ.get("FLASHMEMORY_MODELS_DIR") or Path.home() / ".cache" / "flashmemory" / "models"
    return Path(folder) / LONG_MODEL_FILE


def long_model_path() -> Path:
    """The long model's GGUF: $FLASHMEMORY_LONG_MODEL if set, else the fetch script's default path."""
    given = os.environ.get(LONG_MODEL_ENV)
    if given:
        path = Path(given).expanduser()
        if not path.is_file():
            raise ModelNotFoundError(f"{LONG_MODEL_ENV}={given!r} is not a file; point it at the GGUF or unset it")
        return path
    path = default_long_model_path()
    if not path.is_file():
        raise ModelNotFoundError(
            f"the long-context model is not at {path}; fetch it with `{FETCH_COMMAND}` "
            f"or set {LONG_MODEL_ENV} to its path"
        )
    return path
