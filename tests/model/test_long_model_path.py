"""Finding the long-context model: the env var wins, else the fetch script's path; absence says how to fetch."""

from __future__ import annotations

import pytest

from flashmemory.errors import ModelNotFoundError
from flashmemory.model.long_model import FETCH_COMMAND, LONG_MODEL_FILE, long_model_path


def test_env_var_names_the_long_model(tmp_path, monkeypatch):
    model = tmp_path / "any-name.gguf"
    model.write_bytes(b"GGUF")
    monkeypatch.setenv("FLASHMEMORY_LONG_MODEL", str(model))
    assert long_model_path() == model


def test_env_var_pointing_nowhere_is_an_error_not_a_fallback(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHMEMORY_LONG_MODEL", str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelNotFoundError, match="FLASHMEMORY_LONG_MODEL"):
        long_model_path()


def test_default_path_is_where_the_fetch_script_writes(tmp_path, monkeypatch):
    monkeypatch.delenv("FLASHMEMORY_LONG_MODEL", raising=False)
    monkeypatch.setenv("FLASHMEMORY_MODELS_DIR", str(tmp_path))
    (tmp_path / LONG_MODEL_FILE).write_bytes(b"GGUF")
    assert long_model_path() == tmp_path / LONG_MODEL_FILE


def test_missing_long_model_says_how_to_fetch_it(tmp_path, monkeypatch):
    monkeypatch.delenv("FLASHMEMORY_LONG_MODEL", raising=False)
    monkeypatch.setenv("FLASHMEMORY_MODELS_DIR", str(tmp_path))
    with pytest.raises(ModelNotFoundError) as info:
        long_model_path()
    assert FETCH_COMMAND in str(info.value) and "FLASHMEMORY_LONG_MODEL" in str(info.value)
