"""Shared fixtures: tiny random checkpoints per architecture, and the real SmolLM2 GGUF when installed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.helpers import write_tiny_model

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    write_tiny_model(folder, "LlamaForCausalLM")
    return folder


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from flashmemory.errors import ModelNotFoundError
    from flashmemory.model.default_model import default_model_path

    try:
        return default_model_path()
    except ModelNotFoundError as e:
        pytest.skip(f"embedded model not installed: {e}")


@pytest.fixture(scope="session")
def qwen_path() -> Path:
    """The 32K model's GGUF (Qwen2.5-Coder-0.5B); skips naming the fetch command where it is not on this machine."""
    from flashmemory.errors import ModelNotFoundError
    from flashmemory.model.long_model import long_model_path

    try:
        return long_model_path()
    except ModelNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_path):
    from flashmemory import FlashMemoryEngine

    # float32 activations: the parity with transformers is the float path's (int8's own test:
    # tests/model/test_quantized_weights.py)
    return FlashMemoryEngine(model_path=str(smollm2_path), kv_cache="contiguous",
                             decode_activations="float32")


@pytest.fixture(scope="session")
def alice_text() -> str:
    path = SHARED_DATA / "alice29.txt"
    if not path.is_file():
        pytest.skip(f"{path} is absent (evaluation texts live in ../shared/data)")
    return path.read_text(encoding="utf-8", errors="replace")
