"""GGUF loading: metadata, llama.cpp's q/k permutation, tied output, and every quantized type we dequantize."""

from __future__ import annotations

import pytest
import torch

from flashmemory.kvcache.contiguous import ContiguousKVCache
from flashmemory.kvcache.interface import ForwardBatch
from flashmemory.model.loader import build_model, open_checkpoint
from tests.helpers import write_tiny_gguf, write_tiny_model


def _logits(model, ids: list[int]) -> torch.Tensor:
    cfg = model.config
    cache = ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32, torch.device("cpu"), 256)
    cache.add_sequence(0)
    batch = ForwardBatch.build([(0, 0, len(ids))], torch.device("cpu"))
    return model(torch.tensor(ids), cache, batch)


def _hf_logits_with(hf_model, reference: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    hf_model.load_state_dict(reference, strict=False)
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0"])
def test_gguf_llama_matches_transformers_on_the_dequantized_weights(tmp_path, qtype):
    hf = write_tiny_model(tmp_path / "hf", "LlamaForCausalLM", hidden_size=64, intermediate_size=128)
    reference = write_tiny_gguf(tmp_path / "tiny.gguf", hf, qtype)
    ckpt = open_checkpoint(tmp_path / "tiny.gguf")
    assert ckpt.format == "gguf" and ckpt.config.architecture == "LlamaForCausalLM"
    assert ckpt.config.num_kv_heads == 2 and ckpt.config.head_dim == 16
    model = build_model(ckpt, torch.device("cpu"), torch.float32)
    ids = list(range(3, 60))
    assert (_logits(model, ids) - _hf_logits_with(hf, reference, ids)).abs().max().item() <= 1e-4


def test_gguf_qwen2_with_qkv_bias_and_tied_embeddings(tmp_path):
    hf = write_tiny_model(tmp_path / "hf", "Qwen2ForCausalLM", tie_word_embeddings=True)
    reference = write_tiny_gguf(tmp_path / "q.gguf", hf, "F32", arch="qwen2")
    ckpt = open_checkpoint(tmp_path / "q.gguf")
    assert ckpt.config.qkv_bias and ckpt.config.tie_word_embeddings
    model = build_model(ckpt, torch.device("cpu"), torch.float32)
    ids = list(range(3, 40))
    assert (_logits(model, ids) - _hf_logits_with(hf, reference, ids)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch,gguf_arch,flag", [
    ("Qwen3ForCausalLM", "qwen3", "qk_norm"),  # q and k RMS-normed per head, no QKV bias
    ("Phi3ForCausalLM", "phi3", "fused_projections"),  # attn_qkv, and ffn_up holding gate and up
])
def test_gguf_qwen3_and_phi3_match_transformers(tmp_path, arch, gguf_arch, flag):
    hf = write_tiny_model(tmp_path / "hf", arch, tie_word_embeddings=arch == "Qwen3ForCausalLM")
    reference = write_tiny_gguf(tmp_path / "m.gguf", hf, "Q8_0", arch=gguf_arch)
    ckpt = open_checkpoint(tmp_path / "m.gguf")
    assert ckpt.config.architecture == arch and getattr(ckpt.config, flag)
    assert not ckpt.config.qkv_bias
    model = build_model(ckpt, torch.device("cpu"), torch.float32)
    if ckpt.config.qk_norm:
        assert model.layers[0].self_attn.q_norm.weight.shape == (ckpt.config.head_dim,)
    ids = list(range(3, 40))
    assert (_logits(model, ids) - _hf_logits_with(hf, reference, ids)).abs().max().item() <= 1e-4


def test_vocab_size_is_the_token_list_length_when_the_gguf_states_none(tmp_path):
    hf = write_tiny_model(tmp_path / "hf", "Qwen2ForCausalLM")
    vocab = hf.config.vocab_size
    tokens = [f"t{i}" for i in range(vocab)]  # longer than the reader decodes: only its length is read
    reference = write_tiny_gguf(tmp_path / "q.gguf", hf, "Q8_0", arch="qwen2", state_vocab_size=False,
                                token_strings=tokens)
    ckpt = open_checkpoint(tmp_path / "q.gguf")
    assert ckpt.config.vocab_size == vocab and not ckpt.config.tie_word_embeddings
    model = build_model(ckpt, torch.device("cpu"), torch.float32)
    ids = list(range(3, 40))
    assert (_logits(model, ids) - _hf_logits_with(hf, reference, ids)).abs().max().item() <= 1e-4


def test_vocab_size_falls_back_to_the_embedding_rows(tmp_path):
    hf = write_tiny_model(tmp_path / "hf", "Qwen2ForCausalLM")
    write_tiny_gguf(tmp_path / "q.gguf", hf, "F32", arch="qwen2", state_vocab_size=False)
    assert open_checkpoint(tmp_path / "q.gguf").config.vocab_size == hf.config.vocab_size


def test_embedded_smollm2_metadata(smollm2_path):
    ckpt = open_checkpoint(smollm2_path)
    cfg = ckpt.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert cfg.max_position_embeddings == 8192 and cfg.tie_word_embeddings
    assert ckpt.tensors.tensor_type_counts().keys() >= {"Q4_1", "Q8_0", "F32"}


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_tensor_is_dequantized_in_place(tmp_path, qtype):
    """K-quants (256-element super-blocks): the `gguf` package can read but not write them, so the test
    writes random super-blocks with sane fp16 scales and checks our loader's tensor equals the reference
    dequantization, in HF layout."""
    import gguf
    import numpy as np

    hf = write_tiny_model(tmp_path / "hf", "LlamaForCausalLM", intermediate_size=256)
    path = tmp_path / "k.gguf"
    t = gguf.GGMLQuantizationType[qtype]
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[t]
    rows, cols = 64, 256  # ffn_down: [hidden, intermediate]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(rows, cols // block_elems * block_bytes), dtype=np.uint8)
    # Put small finite fp16 values where each K-quant keeps its super-block scales (last 2 or 4 bytes,
    # or the first 4 for Q4_K/Q5_K) so the reference has no inf/nan.
    scale_bytes = np.frombuffer(np.float16(0.01).tobytes() * 2, dtype=np.uint8)
    blocks = raw.reshape(rows, -1, block_bytes)
    if qtype in ("Q4_K", "Q5_K"):
        blocks[..., 0:4] = scale_bytes
    elif qtype == "Q2_K":
        blocks[..., -4:] = scale_bytes
    else:
        blocks[..., -2:] = scale_bytes[:2]
    write_tiny_gguf(path, hf, "F32", raw_tensors={"blk.0.ffn_down.weight": (raw, t)})
    ckpt = open_checkpoint(path)
    assert ckpt.tensors.tensor_type_counts()[qtype] == 1
    ours = ckpt.tensors["model.layers.0.mlp.down_proj.weight"]
    reference = torch.from_numpy(np.array(gguf.quants.dequantize(raw, t), dtype=np.float32)).reshape(rows, cols)
    assert torch.isfinite(reference).all()
    torch.testing.assert_close(ours, reference, rtol=0, atol=0)


def test_lean_reader_keeps_hyper_parameters_and_skips_token_arrays(smollm2_path):
    from flashmemory.model.gguf_file import GGUFFile

    f = GGUFFile(smollm2_path)
    assert f.metadata["llama.block_count"] == 30 and f.metadata["general.languages"] == ["en"]
    assert "tokenizer.ggml.tokens" not in f.metadata  # 49,152 strings: skipped, not decoded
    assert f.array_lengths["tokenizer.ggml.tokens"] == 49152  # but their number is kept
    assert f.array_lengths["general.languages"] == 1
    assert "{% for message in messages %}" in f.metadata["tokenizer.chat_template"]
    assert len(f.tensors) == 272 and f.tensors[0].offset % 32 == 0


def test_gguf_header_cut_short_is_detected(tmp_path, smollm2_path):
    from flashmemory.errors import CorruptWeightsError

    cut = tmp_path / "header.gguf"
    with smollm2_path.open("rb") as src:
        cut.write_bytes(src.read(100_000))  # ends inside the tokenizer arrays
    with pytest.raises(CorruptWeightsError, match="unexpected end of file"):
        open_checkpoint(cut)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_torch_dequantization_equals_the_gguf_reference(qtype):
    import gguf
    import numpy as np

    from flashmemory.model.gguf_dequant import dequantize_torch

    t = gguf.GGMLQuantizationType[qtype]
    x = np.random.default_rng(0).standard_normal((8, 256)).astype(np.float32)
    raw = gguf.quants.quantize(x, t)
    reference = torch.from_numpy(np.array(gguf.quants.dequantize(raw, t), dtype=np.float32))
    assert torch.equal(dequantize_torch(raw, qtype), reference)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_torch_dequantization_of_every_bit_pattern_equals_the_gguf_reference(qtype):
    """Random bytes reach codes a quantizer never writes (e.g. every high-bit pattern of Q5); fp16 scales
    are set to finite values so the comparison is exact."""
    import gguf
    import numpy as np

    from flashmemory.model.gguf_dequant import BLOCK_BYTES, dequantize_torch

    t = gguf.GGMLQuantizationType[qtype]
    raw = np.random.default_rng(1).integers(0, 256, size=(16, 8 * BLOCK_BYTES[qtype]), dtype=np.uint8)
    blocks = raw.reshape(16, 8, BLOCK_BYTES[qtype])
    num_scales = 2 if qtype in ("Q4_1", "Q5_1") else 1
    scales = np.random.default_rng(2).uniform(-0.1, 0.1, size=(16, 8, num_scales)).astype(np.float16)
    blocks[..., : 2 * num_scales] = scales.view(np.uint8)
    reference = torch.from_numpy(np.array(gguf.quants.dequantize(raw, t), dtype=np.float32))
    assert torch.equal(dequantize_torch(raw, qtype), reference)


def test_export_to_safetensors_round_trips(tmp_path, tiny_llama):
    """A GGUF exported as a safetensors folder (what the benchmark feeds transformers) gives the same logits."""
    import shutil

    from flashmemory.model.export import export_safetensors

    hf = write_tiny_model(tmp_path / "hf", "LlamaForCausalLM")
    write_tiny_gguf(tmp_path / "m.gguf", hf, "Q8_0")
    ckpt = open_checkpoint(tmp_path / "m.gguf")
    # The exporter takes the tokenizer from the checkpoint's folder; the test GGUF has none, so borrow one.
    for f in (tiny_llama).glob("tokenizer*"):
        shutil.copy(f, tmp_path / f.name)
    ckpt.path = tmp_path  # a folder with tokenizer files, as a GGUF's tokenizer would be cached
    out = export_safetensors(ckpt, tmp_path / "exported")
    again = open_checkpoint(out)
    assert again.format == "safetensors" and again.config.num_layers == ckpt.config.num_layers
    a = build_model(open_checkpoint(tmp_path / "m.gguf"), torch.device("cpu"), torch.float32)
    b = build_model(again, torch.device("cpu"), torch.float32)
    ids = list(range(3, 40))
    assert torch.equal(_logits(a, ids), _logits(b, ids))
