"""The fused decode layer (model/native/decode_layer.py): a decode step's layers as two native calls
each give the per-op path's logits bit for bit (Llama, Qwen2 with q/k/v biases, Phi-3's fused
projections; float and 8-bit x; one row and a few rows at once), and layers it cannot take (Qwen3's
per-head q/k norm, dense weights) keep the per-op path."""

from __future__ import annotations

import pytest
import torch

from flashmemory.model.llama import DecoderLayer
from flashmemory.model.loader import build_model, open_checkpoint
from flashmemory.model.native import quant_kernels
from flashmemory.model.native.decode_layer import FusedDecodeLayer
from tests.helpers import write_tiny_gguf, write_tiny_model
from tests.model.test_quantized_weights import _logits

pytestmark = pytest.mark.skipif(quant_kernels.library() is None,
                                reason="no C compiler: no native kernels")


def _model(tmp_path, arch: str, gguf_arch: str, type_name: str, activations: str):
    hf = write_tiny_model(tmp_path / "hf", arch, hidden_size=64, intermediate_size=128)
    write_tiny_gguf(tmp_path / "m.gguf", hf, type_name, arch=gguf_arch)
    return build_model(open_checkpoint(tmp_path / "m.gguf"), torch.device("cpu"), torch.float32,
                       "auto", activations)


def _per_op(model) -> None:
    for layer in model.layers:
        layer.fused_decode = False


@pytest.mark.parametrize("activations", ["float32", "int8"])
@pytest.mark.parametrize("arch,gguf_arch,type_name", [
    ("LlamaForCausalLM", "llama", "Q8_0"),
    ("LlamaForCausalLM", "llama", "Q4_1"),
    ("Qwen2ForCausalLM", "qwen2", "Q4_0"),  # q/k/v biases
    ("Phi3ForCausalLM", "phi3", "Q8_0"),  # one qkv and one gate_up tensor in the file
])
def test_the_fused_layers_give_the_per_op_logits_bit_for_bit(tmp_path, arch, gguf_arch, type_name,
                                                             activations):
    model = _model(tmp_path, arch, gguf_arch, type_name, activations)
    ids = list(range(3, 40))
    fused = _logits(model, ids, prefill=24)
    assert all(isinstance(layer._fused, FusedDecodeLayer) for layer in model.layers)
    _per_op(model)
    assert torch.equal(fused, _logits(model, ids, prefill=24))


def test_a_few_rows_at_once_are_fused_too(tmp_path):
    """A speculative verification's rows (up to MAX_X_ROWS) go through the same two calls."""
    model = _model(tmp_path, "LlamaForCausalLM", "llama", "Q8_0", "int8")
    layer = model.layers[0]
    x = torch.randn(5, 64)
    cos, sin = model.rotary.cos_sin(torch.arange(5), 5)
    fused = FusedDecodeLayer.build(layer)
    assert fused is not None and fused.takes(x, cos.contiguous(), sin.contiguous())
    q, k, v = fused.pre(x, cos.contiguous(), sin.contiguous())
    attn = torch.randn(5, layer.self_attn.num_heads, layer.self_attn.head_dim)
    out = fused.post(x, attn)
    # the per-op path on the same rows
    from flashmemory.model.native import step_ops

    qkv = layer.self_attn.qkv_proj(layer.input_layernorm(x))
    sizes = [layer.self_attn.q_size, layer.self_attn.kv_size, layer.self_attn.kv_size]
    qq, kk, vv = (t.contiguous() for t in qkv.split(sizes, dim=-1))
    qq, kk = qq.view_as(q).contiguous(), kk.view_as(k).contiguous()
    assert step_ops.rope_(qq, kk, cos.contiguous(), sin.contiguous())
    assert torch.equal(q, qq) and torch.equal(k, kk) and torch.equal(v, vv.view_as(v))
    h = x + layer.self_attn.o_proj(attn.reshape(5, -1))
    assert torch.equal(out, h + layer.mlp(layer.post_attention_layernorm(h)))
    assert not fused.takes(torch.randn(quant_kernels.MAX_X_ROWS + 1, 64), cos, sin)


def test_layers_it_cannot_take_keep_the_per_op_path(tmp_path):
    qwen3 = _model(tmp_path / "q3", "Qwen3ForCausalLM", "qwen3", "Q8_0", "auto")
    assert FusedDecodeLayer.build(qwen3.layers[0]) is None  # its per-head q/k norm runs in torch
    write_tiny_model(tmp_path / "dense", "LlamaForCausalLM", hidden_size=64, intermediate_size=128)
    dense = build_model(open_checkpoint(tmp_path / "dense"), torch.device("cpu"), torch.float32)
    assert isinstance(dense.layers[0], DecoderLayer)
    assert FusedDecodeLayer.build(dense.layers[0]) is None
    ids = list(range(3, 30))
    assert torch.isfinite(_logits(qwen3, ids, prefill=20)).all()
