"""Write any checkpoint we can open as a Hugging Face safetensors folder (dequantized), with its tokenizer."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from flashmemory.model.loader import Checkpoint
from flashmemory.model.model_config import ModelConfig
from flashmemory.model.registry import BY_HF_NAME
from flashmemory.model.tokenizer import Tokenizer


def hf_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json transformers needs to rebuild the same model."""
    out: dict[str, Any] = {
        "architectures": [cfg.architecture],
        "model_type": BY_HF_NAME[cfg.architecture].model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else cfg.eos_token_ids,
        "torch_dtype": "float32",
    }
    if cfg.architecture == "LlamaForCausalLM":
        out["attention_bias"] = cfg.qkv_bias
    if cfg.sliding_window_tokens:
        out["sliding_window"] = cfg.sliding_window_tokens
    return out


def export_safetensors(checkpoint: Checkpoint, out_dir: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Dequantize every tensor into `out_dir` (config.json, model.safetensors, tokenizer files); atomic."""
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {name: checkpoint.tensors[name].to(dtype).contiguous() for name in checkpoint.tensors}
    if checkpoint.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(hf_config_dict(checkpoint.config), indent=2))
    Tokenizer.from_checkpoint(checkpoint.path, checkpoint.config.eos_token_ids).hf.save_pretrained(str(tmp))
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return out_dir
