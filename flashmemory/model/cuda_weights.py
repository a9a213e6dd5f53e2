"""Weight-only int8 / int4 projections on a CUDA device through torchao (weights_dtype="q8_0" / "q4_0" there).

On the CPU those settings store GGUF Q8_0 / Q4_0 blocks read by our C GEMV (quantized.py, linear.py); on CUDA
the same settings hand the decoder's projection matrices to torchao 0.18, which swaps each DenseLinear's weight
for one of its tensor subclasses. DenseLinear subclasses nn.Linear and calls F.linear, so torchao's
`quantize_` finds the projections and its subclasses' F.linear overrides run the product:

- "q8_0" -> Int8WeightOnlyConfig(PerRow()): symmetric int8, one float32 scale per output row (Int8Tensor;
  torchao/quantization/quantize_/workflows/int8/int8_tensor.py). In eager mode its F.linear converts the whole
  int8 matrix to the activation dtype at each call before one GEMM: it saves memory, not time.
- "q4_0" -> Int4WeightOnlyConfig(group_size=32, packing "tile_packed_to_4d"): asymmetric int4 in groups of 32
  along the input (Q4_0's block size; tinygemm takes 32, 64, 128 or 256), a bfloat16 scale and zero per group,
  run by torch's own tinygemm kernel (aten._weight_int4pack_mm, compute capability 8.0 or newer, bfloat16
  weights). torchao's default int4 packing ("plain") needs the separate mslk package; tinygemm needs only torch.

Embeddings, norms and the output head stay dense bfloat16. The head is the one matrix whose error lands straight
on the logits (greedy picks flip there first; llama.cpp's own quantizers keep it at Q6_K or better), it is often
tied to the embedding table (SmolLM2, the small Qwen2.5 and Llama 3.2 models), and tinygemm's empty-input path
returns the wrong width for a matrix wider than its padded input (a prefill chunk whose logits are not wanted
asks the head for zero rows).
"""

from __future__ import annotations

import importlib
import importlib.metadata
from types import ModuleType
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from flashmemory.errors import ConfigError
from flashmemory.model.model_config import ModelConfig

TORCHAO_VERSION = "0.18.0"  # the version read and tested; pyproject's `cuda` extra pins it
INSTALL_HINT = f"pip install torchao=={TORCHAO_VERSION} (or pip install 'flashmemory-runtime[cuda]')"
TORCHAO_DTYPES = ("q8_0", "q4_0")  # the weights_dtype values torchao serves on CUDA
INT4_GROUP_SIZE = 32  # Q4_0's block
# tinygemm pads every matrix it packs: input features to a multiple of 1024, output features to one of 8
# (Int4TilePackedTo4dTensor.from_hp); the padding is stored, so it counts in the bytes.
INT4_IN_MULTIPLE = 1024
INT4_OUT_MULTIPLE = 8
INT4_MIN_CAPABILITY = (8, 0)  # tinygemm's tensor-core kernel


def uses_torchao(weights_dtype: str, device: torch.device) -> bool:
    """Whether this setting on this device is served by torchao (else: our C kernels or dense weights)."""
    return weights_dtype in TORCHAO_DTYPES and device.type == "cuda"


def require_torchao() -> ModuleType:
    """The torchao module, or a ConfigError naming the install command."""
    try:
        return importlib.import_module("torchao")
    except ImportError as e:
        raise ConfigError(f"weights_dtype='q8_0'/'q4_0' on a CUDA device quantizes the projections with torchao, "
                          f"which is not installed ({e}); {INSTALL_HINT}; or use weights_dtype='bfloat16'") from e


def check_cuda_weights(weights_dtype: str, device: torch.device) -> None:
    """Refuse, before any weight is read, what cannot run: torchao missing, int4 on a GPU older than sm80."""
    require_torchao()
    if weights_dtype == "q4_0" and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability(device)
        if capability < INT4_MIN_CAPABILITY:
            raise ConfigError(
                f"weights_dtype='q4_0' on CUDA runs torchao's int4 tinygemm kernel, which needs compute capability "
                f"{INT4_MIN_CAPABILITY[0]}.{INT4_MIN_CAPABILITY[1]} or newer; {torch.cuda.get_device_name(device)} "
                f"is {capability[0]}.{capability[1]}: use weights_dtype='q8_0' or 'bfloat16'")


def torchao_config(weights_dtype: str) -> Any:
    """torchao's config for a setting. set_inductor_config=False: we do not compile, and it would change
    torch._inductor's process-wide settings."""
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, PerRow
    from torchao.quantization.quantize_.workflows import Int4PackingFormat

    if weights_dtype == "q8_0":
        return Int8WeightOnlyConfig(granularity=PerRow(), set_inductor_config=False)
    if weights_dtype == "q4_0":
        return Int4WeightOnlyConfig(group_size=INT4_GROUP_SIZE, set_inductor_config=False,
                                    int4_packing_format=Int4PackingFormat.TILE_PACKED_TO_4D)
    raise ConfigError(f"weights_dtype={weights_dtype!r} has no torchao form; use one of {', '.join(TORCHAO_DTYPES)}")


def _is_dense_linear(module: nn.Module, name: str) -> bool:
    return isinstance(module, nn.Linear) and not is_traceable_wrapper_subclass(module.weight)


def quantize_layer(layer: nn.Module, weights_dtype: str) -> None:
    """Replace a decoder layer's projections' weights (bfloat16, on their device) by torchao's weight-only tensors,
    in place; called on each layer as it loads, so only one layer's bfloat16 matrices exist at a time."""
    from torchao.quantization import quantize_

    quantize_(layer, torchao_config(weights_dtype), filter_fn=_is_dense_linear)


def projection_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """[rows, cols] of one decoder layer's projections as our decoder fuses them: qkv, o, gate_up, down."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)]


def projection_bytes(rows: int, cols: int, weights_dtype: str) -> int:
    """Bytes torchao keeps for one [rows, cols] projection (read from its 0.18 layouts; tests check them)."""
    if weights_dtype == "q8_0":  # int8 codes, a float32 scale and an int8 zero point per row
        return rows * cols + rows * (4 + 1)
    if weights_dtype == "q4_0":  # 4-bit codes and a bfloat16 (scale, zero) pair per group, padded
        padded_rows = -(-rows // INT4_OUT_MULTIPLE) * INT4_OUT_MULTIPLE
        padded_cols = -(-cols // INT4_IN_MULTIPLE) * INT4_IN_MULTIPLE
        return padded_rows * padded_cols // 2 + padded_rows * (padded_cols // INT4_GROUP_SIZE) * 2 * 2
    raise ConfigError(f"weights_dtype={weights_dtype!r} has no torchao form; use one of {', '.join(TORCHAO_DTYPES)}")


def torchao_weights_bytes(cfg: ModelConfig, weights_dtype: str, dtype: torch.dtype) -> int:
    """Bytes of the whole model as build_model keeps it under torchao: the projections in torchao's layout; their
    biases, the head and a tied embedding table bfloat16; norms and an untied embedding table in `dtype` (the
    activations')."""
    h, v = cfg.hidden_size, cfg.vocab_size
    size = torch.empty((), dtype=dtype).element_size()
    projections = sum(projection_bytes(r, c, weights_dtype) for r, c in projection_shapes(cfg))
    biases = 2 * projection_shapes(cfg)[0][0] if cfg.qkv_bias else 0
    norms = (2 * cfg.num_layers + 1) * h * size
    tables = v * h * 2 if cfg.tie_word_embeddings else v * h * (size + 2)
    return cfg.num_layers * (projections + biases) + norms + tables


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds: a tensor subclass (torchao's) counts the tensors inside it, not its logical shape."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, name)) for name in names)
    return t.numel() * t.element_size()


def torchao_version() -> str | None:
    """The installed torchao's version without importing it (importing takes seconds), or None."""
    try:
        return importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        return None
