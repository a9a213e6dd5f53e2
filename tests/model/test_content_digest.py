"""model_content_digest: a model's identity is its bytes, not its path; every byte counts; a
restart reads nothing again."""

from __future__ import annotations

import shutil

import pytest

from flashmemory.model import content_digest
from flashmemory.model.content_digest import model_content_digest


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHMEMORY_CACHE_DIR", str(tmp_path / "cache"))


def _model(path, middle: bytes = b"\x00") -> None:
    path.write_bytes(b"GGUF" + b"a" * 5_000_000 + middle + b"b" * 5_000_000)


def test_the_same_bytes_at_two_paths_are_one_model(tmp_path):
    _model(tmp_path / "m.gguf")
    (tmp_path / "elsewhere").mkdir()
    shutil.copy(tmp_path / "m.gguf", tmp_path / "elsewhere" / "m.gguf")
    assert model_content_digest(tmp_path / "m.gguf") == \
        model_content_digest(tmp_path / "elsewhere" / "m.gguf")


def test_one_byte_in_the_middle_is_another_model(tmp_path):
    _model(tmp_path / "a.gguf", b"\x00")
    _model(tmp_path / "b.gguf", b"\x01")  # same size, same ends
    assert model_content_digest(tmp_path / "a.gguf") != model_content_digest(tmp_path / "b.gguf")


def test_a_folder_counts_its_model_files_only(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"w" * 100)
    before = model_content_digest(folder)
    (folder / "README.md").write_text("notes")  # not part of the model
    assert model_content_digest(folder) == before
    (folder / "config.json").write_text('{"a": 1}')
    assert model_content_digest(folder) != before


def test_a_restart_reads_nothing_again_unless_the_file_changed(tmp_path, monkeypatch):
    _model(tmp_path / "m.gguf")
    first = model_content_digest(tmp_path / "m.gguf")

    def unread(path):
        raise AssertionError(f"{path} read again")

    monkeypatch.setattr(content_digest, "_file_digest", unread)
    assert model_content_digest(tmp_path / "m.gguf") == first
    monkeypatch.undo()
    monkeypatch.setenv("FLASHMEMORY_CACHE_DIR", str(tmp_path / "cache"))
    _model(tmp_path / "m.gguf", b"\x02")  # rewritten: a new size or time
    assert model_content_digest(tmp_path / "m.gguf") != first


def test_an_unreadable_cache_is_computed_again(tmp_path):
    _model(tmp_path / "m.gguf")
    first = model_content_digest(tmp_path / "m.gguf")
    (tmp_path / "cache" / content_digest.CACHE_NAME).write_text("{not json")
    assert model_content_digest(tmp_path / "m.gguf") == first
