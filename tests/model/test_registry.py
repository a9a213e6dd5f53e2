"""The architecture registry is the one place a Llama-family variant is declared."""

from __future__ import annotations

import json

import pytest
import torch

from flashmemory.errors import UnsupportedModelError
from flashmemory.model import loader, registry
from flashmemory.model.export import hf_config_dict
from flashmemory.model.model_config import ModelConfig
from tests.helpers import tiny_hf_config


def _config_dict(arch: str) -> dict:
    cfg = tiny_hf_config("LlamaForCausalLM", 320).to_dict()
    cfg["architectures"] = [arch]
    return json.loads(json.dumps(cfg))


def test_every_architecture_has_a_decoder_family():
    for arch in registry.ARCHITECTURES:
        assert arch.family in loader.DECODER_FAMILIES, arch


def test_a_variant_is_one_registry_line(monkeypatch):
    with pytest.raises(UnsupportedModelError, match="not supported"):
        ModelConfig.from_hf_dict(_config_dict("MyLlamaForCausalLM"))
    variant = registry.Architecture("MyLlamaForCausalLM", model_type="myllama",
                                    gguf_name="myllama", qkv_bias=True)
    monkeypatch.setitem(registry.BY_HF_NAME, variant.hf_name, variant)
    config = ModelConfig.from_hf_dict(_config_dict("MyLlamaForCausalLM"))
    assert config.architecture == "MyLlamaForCausalLM" and config.qkv_bias
    model = loader.DECODER_FAMILIES[variant.family](config, device=torch.device("cpu"), dtype=torch.float32)
    assert model.layers[0].self_attn.qkv_proj.bias is not None  # the registry's q/k/v bias reached the decoder


def test_export_writes_the_model_type_of_any_registry_line(monkeypatch):
    """model/export.py reads the model_type from the registry: a new line exports, no KeyError."""
    variant = registry.Architecture("MyLlamaForCausalLM", model_type="myllama", gguf_name=None,
                                    qkv_bias=False)
    monkeypatch.setitem(registry.BY_HF_NAME, variant.hf_name, variant)
    config = ModelConfig.from_hf_dict(_config_dict("MyLlamaForCausalLM"))
    assert hf_config_dict(config)["model_type"] == "myllama"


def test_every_model_type_is_the_one_transformers_reads():
    import transformers

    for arch in registry.ARCHITECTURES:
        assert getattr(transformers, arch.hf_name).config_class.model_type == arch.model_type, arch


def test_gguf_names_map_to_hf_architectures():
    assert registry.BY_GGUF_NAME["qwen2"].hf_name == "Qwen2ForCausalLM"
    assert registry.BY_GGUF_NAME["llama"].hf_name == "LlamaForCausalLM"
    assert "MistralForCausalLM" in registry.BY_HF_NAME  # its GGUFs are written as "llama"
