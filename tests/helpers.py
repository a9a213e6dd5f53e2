"""Builders for tiny random checkpoints (written like real ones) shared by the tests."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

CORPUS = (
    "Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to do. "
    "The capital of France is Paris. Caf\u00e9 cr\u00e8me, na\u00efve r\u00e9sum\u00e9, \u4f60\u597d\u4e16\u754c, "
    "emoji \U0001f600\U0001f680 and numbers 0123456789. "
) * 4
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def write_tiny_tokenizer(folder: Path, vocab_size: int = 320, corpus: str = CORPUS) -> int:
    """Train a byte-level BPE on a small corpus and save it as a transformers tokenizer; returns its
    size (259: the bytes and the control tokens, no merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([corpus], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))
    return len(fast)


def tiny_hf_config(arch: str, vocab_size: int, **overrides: Any):
    """A small random config of the given HF architecture (2 layers, GQA 4:2, head_dim 16)."""
    import transformers

    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    )
    common.update(overrides)
    cls = {
        "LlamaForCausalLM": transformers.LlamaConfig,
        "Qwen2ForCausalLM": transformers.Qwen2Config,
        "MistralForCausalLM": transformers.MistralConfig,
        "Qwen3ForCausalLM": transformers.Qwen3Config,
        "Phi3ForCausalLM": transformers.Phi3Config,
    }[arch]
    return cls(**common)


def write_tiny_model(folder: Path, arch: str = "LlamaForCausalLM", seed: int = 0,
                     tokenizer_size: int = 320, tokenizer_corpus: str = CORPUS, **overrides: Any):
    """Write a tiny random HF checkpoint (config.json, model.safetensors, a tokenizer of
    `tokenizer_size` trained on `tokenizer_corpus`) and return the HF model."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_tiny_tokenizer(folder, tokenizer_size, tokenizer_corpus)
    config = tiny_hf_config(arch, vocab, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).float().eval()
    with torch.no_grad():  # random init is tiny; widen it so logits differ meaningfully between tokens
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(str(folder), safe_serialization=True)
    return model


def read_config(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "config.json").read_text())


def _llama_cpp_permute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    # What llama.cpp's converter does to q/k rows (rotate-half -> interleaved layout).
    rows = w.shape[0]
    return w.reshape(num_heads, 2, rows // num_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def write_tiny_gguf(
    path: Path, hf_model, qtype_name: str = "F32", arch: str = "llama", raw_tensors: dict | None = None,
    state_vocab_size: bool = True, token_strings: list[str] | None = None,
) -> dict[str, torch.Tensor]:
    """Write `hf_model` as a GGUF the way llama.cpp's converter lays it out; 2-D weights in `qtype_name`.

    `raw_tensors` maps GGUF tensor names to (already encoded uint8 array, GGMLQuantizationType) written instead.
    `state_vocab_size=False` leaves out `<arch>.vocab_size` (as Qwen2.5's GGUFs do); `token_strings` is
    written as tokenizer.ggml.tokens.

    Returns the HF-named float32 tensors as they read back after quantization (the reference weights).
    """
    import gguf
    import numpy as np

    cfg = hf_model.config
    qtype = gguf.GGMLQuantizationType[qtype_name]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None)
    # as Qwen3's GGUFs state it
    if head_dim and head_dim != cfg.hidden_size // cfg.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if state_vocab_size:
        writer.add_vocab_size(cfg.vocab_size)
    if token_strings is not None:
        writer.add_token_list(token_strings)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    reference: dict[str, torch.Tensor] = {}
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
                 "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
                 "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
                 "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
                 "self_attn.v_proj.bias": "attn_v.bias", "mlp.gate_proj.weight": "ffn_gate.weight",
                 "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
                 "self_attn.q_norm.weight": "attn_q_norm.weight",
                 "self_attn.qkv_proj.weight": "attn_qkv.weight",
                 "mlp.gate_up_proj.weight": "ffn_up.weight",
                 "self_attn.k_norm.weight": "attn_k_norm.weight"}
    state = hf_model.state_dict()
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for hf_name, tensor in state.items():
        if hf_name.startswith("model.layers."):
            _, _, idx, rest = hf_name.split(".", 3)
            gguf_name = f"blk.{idx}.{per_layer[rest]}"
        else:
            gguf_name = names[hf_name]
        w = tensor.detach().float()
        if w.dim() == 2 and qtype != gguf.GGMLQuantizationType.F32:
            # Quantization blocks run along rows, so it commutes with the row permutation below.
            back = gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), qtype), qtype)
            reference[hf_name] = torch.from_numpy(np.array(back, dtype=np.float32)).reshape(tensor.shape)
        else:
            reference[hf_name] = w.clone()
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            w = _llama_cpp_permute(w, cfg.num_attention_heads)
        elif arch == "llama" and hf_name.endswith("k_proj.weight"):
            w = _llama_cpp_permute(w, cfg.num_key_value_heads)
        array = w.numpy()
        if raw_tensors and gguf_name in raw_tensors:
            raw, raw_type = raw_tensors[gguf_name]
            writer.add_tensor(gguf_name, raw, raw_dtype=raw_type)
        elif array.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference


def wait_for(condition: Callable[[], bool], timeout_s: float = 5.0,
             interval_s: float = 0.002) -> bool:
    """Poll `condition` until it holds or `timeout_s` passes; its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval_s)
    return condition()
