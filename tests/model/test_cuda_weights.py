"""weights_dtype="q8_0"/"q4_0" on CUDA through torchao (flashmemory/model/cuda_weights.py), tested without a GPU:
int8 weight-only runs on CPU tensors, so the same per-layer quantization is applied to a tiny model here; int4
(tinygemm) is CUDA-only, so its stored layout is checked on the meta device and its logits only where a GPU is."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from flashmemory.errors import ConfigError
from flashmemory.model import cuda_weights
from flashmemory.model.linear import QuantizedLinear
from flashmemory.model.llama import LlamaModel
from flashmemory.model.loader import StoredWeights, build_model, open_checkpoint, weights_bytes
from tests.helpers import write_tiny_model
from tests.model.test_quantized_weights import _logits


def _torchao():
    return pytest.importorskip("torchao", reason=f"torchao is not installed: {cuda_weights.INSTALL_HINT}")


def _tiny(tmp_path, arch: str = "LlamaForCausalLM", **overrides):
    write_tiny_model(tmp_path / "hf", arch, hidden_size=64, intermediate_size=128, **overrides)
    return open_checkpoint(tmp_path / "hf")


def _torchao_model(ckpt, weights_dtype: str, device: torch.device) -> LlamaModel:
    """What build_model does on CUDA, on any device: bfloat16 matrices, each layer quantized once it is loaded."""
    model = LlamaModel(ckpt.config, device=device, dtype=torch.float32, weights_dtype=torch.bfloat16)
    model.load_hf_state_dict(StoredWeights(ckpt, "bfloat16", device),
                             finish_layer=lambda layer: cuda_weights.quantize_layer(layer, weights_dtype))
    return model


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])  # Qwen2: q/k/v biases
def test_int8_weight_only_projections_give_the_bfloat16_logits_closely(tmp_path, arch):
    _torchao()
    from torchao.quantization import Int8Tensor

    ckpt = _tiny(tmp_path, arch, tie_word_embeddings=False)
    model = _torchao_model(ckpt, "q8_0", torch.device("cpu"))
    dense = build_model(ckpt, torch.device("cpu"), torch.float32, "bfloat16")
    layer = model.layers[0]
    for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert isinstance(proj.weight, Int8Tensor)
    assert not isinstance(model.lm_head.weight, Int8Tensor) and model.lm_head.weight.dtype == torch.bfloat16
    # The reference of the same arithmetic: the bfloat16 model whose projections are torchao's own dequantization.
    reference = build_model(ckpt, torch.device("cpu"), torch.float32, "bfloat16")
    for quantized, plain in zip(model.layers, reference.layers):
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            plain.get_submodule(name).weight = nn.Parameter(quantized.get_submodule(name).weight.dequantize(),
                                                            requires_grad=False)
    ids = list(range(3, 40))
    a, b, r = _logits(model, ids, 30), _logits(dense, ids, 30), _logits(reference, ids, 30)
    scale = b.abs().max().item()
    # F.linear reached torchao's int8 product: it equals the dequantized model's up to bfloat16 rounding (the
    # distance of bfloat16 from float32 here, about 1 % of the largest logit) ...
    assert (a - r).abs().max().item() <= 0.02 * scale
    # ... and int8 per row moves the logits about twice that from bfloat16's. (Greedy-token agreement needs a
    # trained model, not these near-tied random logits: bench/cuda_weights_check.py measures it on SmolLM2.)
    assert (a - b).abs().max().item() <= 0.05 * scale


@pytest.mark.parametrize("tied", [False, True])
def test_int8_bytes_are_counted_as_stored_and_estimated_before_loading(tmp_path, tied):
    _torchao()
    ckpt = _tiny(tmp_path, "Qwen2ForCausalLM", tie_word_embeddings=tied)
    model = _torchao_model(ckpt, "q8_0", torch.device("cpu"))
    dense = build_model(ckpt, torch.device("cpu"), torch.float32, "bfloat16")
    assert model.num_parameters() == dense.num_parameters()  # logical shapes unchanged
    assert model.num_parameter_bytes() < 0.75 * dense.num_parameter_bytes()  # the head and embeddings stay dense
    # The estimate the engine sizes the device budget with, before reading a weight, is the loaded model's count.
    assert weights_bytes(ckpt, "q8_0", torch.float32, torch.device("cuda")) == model.num_parameter_bytes()


@pytest.mark.parametrize("shape", [(1728, 576), (576, 1536), (96, 64), (4096, 4096), (1000, 14336)])
def test_projection_bytes_match_torchaos_layouts(shape, monkeypatch):
    """int4's tinygemm packing is built on the meta device (its capability check patched): the byte formula the
    budget uses equals what torchao 0.18 stores, padding included; int8's on real CPU tensors."""
    _torchao()
    from torchao.quantization import Int8Tensor, PerRow
    from torchao.quantization.quantize_.workflows.int4.int4_tile_packed_to_4d_tensor import Int4TilePackedTo4dTensor

    rows, cols = shape
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    int4 = Int4TilePackedTo4dTensor.from_hp(torch.empty(rows, cols, dtype=torch.bfloat16, device="meta"),
                                            [1, cuda_weights.INT4_GROUP_SIZE])
    assert cuda_weights.tensor_bytes(int4) == cuda_weights.projection_bytes(rows, cols, "q4_0")
    if rows * cols <= 2**20:
        int8 = Int8Tensor.from_hp(torch.randn(rows, cols, dtype=torch.bfloat16), granularity=PerRow())
        assert cuda_weights.tensor_bytes(int8) == cuda_weights.projection_bytes(rows, cols, "q8_0")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="int4 tinygemm (aten._weight_int4pack_mm) runs on CUDA "
                    "only; bench/cuda_weights_check.py measures it on a GPU")
@pytest.mark.parametrize("weights_dtype", ["q8_0", "q4_0"])
def test_on_cuda_the_setting_loads_torchao_projections(tmp_path, weights_dtype):
    _torchao()
    ckpt = _tiny(tmp_path)
    cuda = torch.device("cuda")
    model = build_model(ckpt, cuda, torch.bfloat16, weights_dtype)
    dense = build_model(ckpt, cuda, torch.bfloat16, "bfloat16")
    assert model.num_parameter_bytes() == weights_bytes(ckpt, weights_dtype, torch.bfloat16, cuda)
    ids = list(range(3, 40))
    a, b = _logits_on(model, ids, cuda), _logits_on(dense, ids, cuda)
    assert (a - b).abs().max().item() <= 0.1 * b.abs().max().item()


def _logits_on(model: LlamaModel, ids: list[int], device: torch.device) -> torch.Tensor:
    from flashmemory.kvcache.contiguous import ContiguousKVCache
    from flashmemory.kvcache.interface import ForwardBatch

    cfg = model.config
    cache = ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, device, len(ids))
    cache.add_sequence(0)
    batch = ForwardBatch.build([(0, 0, len(ids))], device)
    return model(torch.tensor(ids, device=device), cache, batch).cpu()


def test_missing_torchao_on_cuda_is_a_config_error_naming_the_install(tmp_path, monkeypatch):
    ckpt = _tiny(tmp_path)
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao now raises ImportError
    for weights_dtype in ("q8_0", "q4_0"):
        with pytest.raises(ConfigError, match=r"pip install torchao==0\.18\.0"):
            StoredWeights(ckpt, weights_dtype, torch.device("cuda"))
    StoredWeights(ckpt, "q8_0", torch.device("cpu"))  # the CPU's C kernels need no torchao


def test_int4_on_a_gpu_older_than_sm80_is_refused_with_the_fix(tmp_path, monkeypatch):
    _torchao()
    ckpt = _tiny(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla T4")
    with pytest.raises(ConfigError, match="compute capability 8.0 .* Tesla T4 is 7.5: use weights_dtype='q8_0'"):
        StoredWeights(ckpt, "q4_0", torch.device("cuda"))
    StoredWeights(ckpt, "q8_0", torch.device("cuda"))  # int8 has no such limit


def test_on_the_cpu_q8_0_and_q4_0_keep_the_block_formats(tmp_path):
    ckpt = _tiny(tmp_path)
    for weights_dtype in ("q8_0", "q4_0"):
        assert not cuda_weights.uses_torchao(weights_dtype, torch.device("cpu"))
        model = build_model(ckpt, torch.device("cpu"), torch.float32, weights_dtype)
        assert isinstance(model.layers[0].self_attn.qkv_proj, QuantizedLinear)
    assert cuda_weights.uses_torchao("q4_0", torch.device("cuda:1"))
    assert not cuda_weights.uses_torchao("bfloat16", torch.device("cuda"))


def test_the_gpu_check_script_says_no_cuda_device_and_measures_nothing(monkeypatch, capsys):
    """bench/cuda_weights_check.py on a CPU-only host: a clear message and status 2, no CPU numbers under its name."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "cuda_weights_check.py"
    spec = importlib.util.spec_from_file_location("cuda_weights_check", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["cuda_weights_check.py"])
    assert script.main() == 2
    assert "no CUDA device" in capsys.readouterr().err
