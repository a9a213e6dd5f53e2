"""Every way a model path can be wrong gets a typed error that names the problem and the fix."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from flashmemory import FlashMemoryEngine
from flashmemory.errors import CorruptWeightsError, ModelNotFoundError, UnsupportedModelError
from flashmemory.model.loader import open_checkpoint


def test_missing_model_path_is_reported(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        FlashMemoryEngine(model_path=str(tmp_path / "nope"))


def test_unreadable_model_path_is_reported(tmp_path, monkeypatch, tiny_llama):
    # Tests run as root in CI, where chmod cannot make a file unreadable: simulate the permission check.
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(tiny_llama) else real_access(p, mode))
    with pytest.raises(ModelNotFoundError, match="not readable"):
        open_checkpoint(tiny_llama)


def test_folder_without_config_is_reported(tmp_path):
    with pytest.raises(ModelNotFoundError, match="config.json"):
        open_checkpoint(tmp_path)


def test_file_that_is_not_a_model_is_reported(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 64)
    with pytest.raises(ModelNotFoundError, match="neither a .gguf file nor a folder"):
        open_checkpoint(path)


def test_unsupported_architecture_names_the_supported_ones(tmp_path, tiny_llama):
    folder = tmp_path / "gpt2"
    shutil.copytree(tiny_llama, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError) as e:
        open_checkpoint(folder)
    for name in ("GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"):
        assert name in str(e.value)


def test_truncated_safetensors_is_detected(tmp_path, tiny_llama):
    folder = tmp_path / "cut"
    shutil.copytree(tiny_llama, folder)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CorruptWeightsError, match="truncated.*download it again"):
        FlashMemoryEngine(model_path=str(folder))


def test_safetensors_with_garbage_header_is_detected(tmp_path, tiny_llama):
    folder = tmp_path / "garbage"
    shutil.copytree(tiny_llama, folder)
    (folder / "model.safetensors").write_bytes(b"\xff" * 100)
    with pytest.raises(CorruptWeightsError, match="not a valid safetensors file"):
        open_checkpoint(folder)


def test_missing_tensor_is_reported_by_name(tmp_path, tiny_llama):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "missing"
    shutil.copytree(tiny_llama, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CorruptWeightsError, match="model.layers.1.mlp.down_proj.weight"):
        FlashMemoryEngine(model_path=str(folder))


def test_truncated_gguf_is_detected(tmp_path, smollm2_path):
    cut = tmp_path / "cut.gguf"
    with smollm2_path.open("rb") as src, cut.open("wb") as dst:
        dst.write(src.read(smollm2_path.stat().st_size // 2))
    with pytest.raises(CorruptWeightsError, match="download it again"):
        open_checkpoint(cut)


def test_gguf_with_garbage_content_is_detected(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x07" * 200)
    with pytest.raises(CorruptWeightsError, match="not a readable GGUF"):
        open_checkpoint(bad)


def test_parameter_count_from_the_config_matches_the_loaded_model(tiny_llama, smollm2_path):
    for path in (tiny_llama, smollm2_path):
        engine = FlashMemoryEngine(model_path=str(path), kv_cache="contiguous")
        counted = engine.model.num_parameters()
        assert engine.model_config.num_parameters() == counted
