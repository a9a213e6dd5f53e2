"""The architectures our decoder runs: one line per architecture (its Hugging Face class and
model_type, its GGUF name, whether q/k/v carry a bias or q/k a per-head norm, whether its files
fuse the projections, and which decoder family builds it). A
Llama-family variant is one line here; a new decoder family is one module beside llama.py plus one
entry in loader.DECODER_FAMILIES."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    hf_name: str  # config.json `architectures[0]`
    model_type: str  # config.json `model_type` (written back by model/export.py)
    gguf_name: str | None  # GGUF `general.architecture`; None where its files are written under another name
    qkv_bias: bool  # q/k/v projections carry a bias
    family: str = "llama"  # the decoder that builds it (loader.DECODER_FAMILIES)
    qk_norm: bool = False  # q and k RMS-normed per head before RoPE (Qwen3)
    # checkpoints store q/k/v as one qkv_proj and gate/up as one gate_up_proj (Phi-3)
    fused: bool = False


ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture("LlamaForCausalLM", model_type="llama", gguf_name="llama", qkv_bias=False),
    # Mistral GGUFs are written as "llama"
    Architecture("MistralForCausalLM", model_type="mistral", gguf_name=None, qkv_bias=False),
    Architecture("Qwen2ForCausalLM", model_type="qwen2", gguf_name="qwen2", qkv_bias=True),
    Architecture("Qwen3ForCausalLM", model_type="qwen3", gguf_name="qwen3", qkv_bias=False,
                 qk_norm=True),
    Architecture("Phi3ForCausalLM", model_type="phi3", gguf_name="phi3", qkv_bias=False,
                 fused=True),
)

BY_HF_NAME: dict[str, Architecture] = {a.hf_name: a for a in ARCHITECTURES}
BY_GGUF_NAME: dict[str, Architecture] = {a.gguf_name: a for a in ARCHITECTURES if a.gguf_name}
