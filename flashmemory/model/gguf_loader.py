"""Read a GGUF checkpoint: metadata -> ModelConfig, tensors dequantized (via the `gguf` package) into HF layout."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import torch

from flashmemory.errors import CorruptWeightsError, UnsupportedModelError
from flashmemory.model.gguf_dequant import dequantize_torch
from flashmemory.model.gguf_file import GGUFFile, GGUFFormatError, GGUFTensorInfo
from flashmemory.model.model_config import ModelConfig
from flashmemory.model.quantized import BLOCK_FORMATS, QuantizedTensor

logger = logging.getLogger(__name__)

# Tensor types we dequantize; the `gguf` package's numpy kernels do the arithmetic.
SUPPORTED_GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                        "IQ4_NL", "IQ4_XS")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",  # fused (Phi-3)
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Where an architecture's converter writes a block tensor under another meaning: Phi-3's ffn_up
# holds gate and up together.
_ARCH_BLOCK_NAMES = {"phi3": {"ffn_up.weight": "mlp.gate_up_proj.weight"}}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def hf_tensor_name(gguf_name: str, arch: str | None = None) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    names = {**_BLOCK_NAMES, **_ARCH_BLOCK_NAMES.get(arch or "", {})}
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}"
    return None


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's convert-time permutation of q/k rows (interleaved -> rotate-half layout)."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    # [num_heads, half, 2, ...] -> [num_heads, 2, half, ...]
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


class GGUFCheckpoint(Mapping[str, torch.Tensor]):
    """Owns an open GGUF file; maps HF tensor names to dequantized float32 tensors on demand."""

    def __init__(self, path: Path) -> None:
        from gguf import GGMLQuantizationType

        self.path = path
        try:
            self._file = GGUFFile(path)
        except (GGUFFormatError, ValueError, OSError) as e:
            raise CorruptWeightsError(
                f"{path} is not a readable GGUF file ({e}); it may be truncated or corrupt — download it again"
            ) from e
        file_size = path.stat().st_size
        needed = max((t.offset + t.num_bytes for t in self._file.tensors), default=0)
        if file_size < needed:
            raise CorruptWeightsError(
                f"{path} is truncated: its tensors need {needed} bytes, the file has {file_size}; download it again"
            )
        self.metadata = self._file.metadata
        self._by_hf_name: dict[str, GGUFTensorInfo] = {}
        self._types: dict[str, GGMLQuantizationType] = {}
        arch = self.metadata.get("general.architecture")
        for t in self._file.tensors:
            name = hf_tensor_name(t.name, arch)
            if name is None:
                logger.debug("ignoring GGUF tensor %s", t.name)
                continue
            qtype = GGMLQuantizationType(t.type_id)
            if qtype.name not in SUPPORTED_GGUF_TYPES:
                raise UnsupportedModelError(
                    f"GGUF tensor {t.name} has type {qtype.name}; supported: {', '.join(SUPPORTED_GGUF_TYPES)}"
                )
            self._by_hf_name[name] = t
            self._types[name] = qtype
        embedding = self._by_hf_name.get("model.embed_tokens.weight")
        self.config = ModelConfig.from_gguf_metadata(
            self.metadata,
            has_output_weight="lm_head.weight" in self._by_hf_name,
            has_qkv_bias="model.layers.0.self_attn.q_proj.bias" in self._by_hf_name,
            num_token_strings=self._file.array_lengths.get("tokenizer.ggml.tokens"),
            embedding_rows=int(embedding.shape[-1]) if embedding is not None and len(embedding.shape) == 2 else None,
        )
        self._permuted = self.metadata.get("general.architecture") == "llama"

    def __getitem__(self, name: str) -> torch.Tensor:
        import gguf

        t = self._by_hf_name[name]
        # numpy shape is the GGML shape reversed: [rows, cols] as torch expects.
        shape = tuple(int(d) for d in reversed(t.shape))
        raw = self._file.raw(t)
        tensor = dequantize_torch(raw, self._types[name].name)  # fast path for the common block types
        if tensor is None:
            array = np.ascontiguousarray(gguf.quants.dequantize(raw, self._types[name]), dtype=np.float32)
            tensor = torch.from_numpy(array)
        tensor = tensor.reshape(shape)
        cfg = self.config
        if self._permuted and name.endswith("q_proj.weight"):
            tensor = unpermute_rope_rows(tensor, cfg.num_heads)
        elif self._permuted and name.endswith("k_proj.weight"):
            tensor = unpermute_rope_rows(tensor, cfg.num_kv_heads)
        return tensor

    def blocks(self, name: str) -> QuantizedTensor | None:
        """The 2-D weight `name` as its GGUF blocks (q/k rows un-permuted), or None when its format is not one the
        native kernels read (then __getitem__ dequantizes it)."""
        t = self._by_hf_name[name]
        type_name = self._types[name].name
        if type_name not in BLOCK_FORMATS or len(t.shape) != 2:
            return None
        blocks = torch.from_numpy(self._file.raw(t))  # [rows, row_bytes], read from the file
        cfg = self.config
        if self._permuted and name.endswith("q_proj.weight"):
            blocks = unpermute_rope_rows(blocks, cfg.num_heads).contiguous()
        elif self._permuted and name.endswith("k_proj.weight"):
            blocks = unpermute_rope_rows(blocks, cfg.num_kv_heads).contiguous()
        return QuantizedTensor(type_name, blocks, int(t.shape[0]))

    def stored_bytes_as_kept(self, dense_element_bytes: int) -> int:
        """Bytes of all tensors as weights_dtype="auto" keeps them: block formats the kernels read at their size in
        the file, the others dense at `dense_element_bytes` per weight."""
        total = 0
        for name, t in self._by_hf_name.items():
            if self._types[name].name in BLOCK_FORMATS and len(t.shape) == 2:
                total += t.num_bytes
            else:
                total += int(np.prod(t.shape)) * dense_element_bytes
        return total

    def __contains__(self, name: object) -> bool:  # Mapping's default would read the tensor
        return name in self._by_hf_name

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_hf_name)

    def __len__(self) -> int:
        return len(self._by_hf_name)

    def tensor_type_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for qtype in self._types.values():
            counts[qtype.name] = counts.get(qtype.name, 0) + 1
        return counts
