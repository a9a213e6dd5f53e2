"""Open a checkpoint (GGUF file or safetensors folder, default: the embedded model) and build our decoder from it."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from flashmemory.errors import ConfigError, ModelNotFoundError
from flashmemory.model import cuda_weights
from flashmemory.model.default_model import default_model_path
from flashmemory.model.gguf_loader import GGUFCheckpoint
from flashmemory.model.hub import looks_like_hub_id, resolve_hub_model
from flashmemory.model.llama import LlamaModel
from flashmemory.model.model_config import ModelConfig
from flashmemory.model.quantized import BLOCK_FORMATS, QuantizedTensor, quantize
from flashmemory.model.registry import BY_HF_NAME
from flashmemory.model.safetensors_loader import SafetensorsCheckpoint

logger = logging.getLogger(__name__)

# registry.Architecture.family -> the decoder class that builds it.
DECODER_FAMILIES: dict[str, type[LlamaModel]] = {"llama": LlamaModel}
# How weights are kept (EngineConfig.weights_dtype): "auto" keeps a GGUF's block formats (the native GEMV reads
# them; formats it does not read are dequantized), "float32" / "bfloat16" store every weight dense in that dtype,
# "q8_0" / "q4_0" quantize a dense checkpoint's matrices at load: on the CPU into those GGUF block formats (our C
# GEMV), on CUDA into torchao's int8 / int4 weight-only tensors (cuda_weights.py).
WEIGHTS_DTYPES = ("auto", "float32", "bfloat16", "q8_0", "q4_0")
_DENSE = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Checkpoint:
    """An opened checkpoint: where it is, its config, and its tensors (HF names, read lazily)."""

    path: Path
    format: str  # "gguf" | "safetensors"
    config: ModelConfig
    tensors: Mapping[str, torch.Tensor]


def resolve_model_path(model_path: str | os.PathLike | None) -> Path:
    """The checkpoint path to load: the given one (checked), or the embedded default model."""
    if model_path is None:
        return default_model_path()
    path = Path(model_path).expanduser()
    if not path.exists() and looks_like_hub_id(str(model_path)):
        return resolve_hub_model(str(model_path))  # org/name[:QUANT][@revision] (model/hub.py)
    if not path.exists():
        raise ModelNotFoundError(
            f"model path {str(path)!r} does not exist; pass a GGUF file, a Hugging Face folder "
            "(config.json + *.safetensors) or Hub id (org/name, org/name:Q4_K_M), or omit it to "
            "use the embedded SmolLM2"
        )
    if not os.access(path, os.R_OK):
        raise ModelNotFoundError(f"model path {str(path)!r} is not readable by this user; check its permissions")
    return path


def open_checkpoint(model_path: str | os.PathLike | None) -> Checkpoint:
    path = resolve_model_path(model_path)
    if path.is_dir():
        ganged = sorted(path.glob("*.gguf"))
        if not (path / "config.json").exists() and len(ganged) == 1:
            path = ganged[0]
        else:
            st = SafetensorsCheckpoint(path)
            return Checkpoint(path, "safetensors", st.config, st)
    if path.suffix.lower() != ".gguf":
        raise ModelNotFoundError(
            f"{path} is neither a .gguf file nor a folder with config.json and *.safetensors"
        )
    gg = GGUFCheckpoint(path)
    logger.info("GGUF %s: tensor types %s", path.name, gg.tensor_type_counts())
    return Checkpoint(path, "gguf", gg.config, gg)


class StoredWeights(Mapping[str, torch.Tensor | QuantizedTensor]):
    """The checkpoint's tensors in the form the model keeps them: matrices as blocks or dense, by weights_dtype."""

    def __init__(self, checkpoint: Checkpoint, weights_dtype: str, device: torch.device) -> None:
        if weights_dtype not in WEIGHTS_DTYPES:
            raise ConfigError(f"weights_dtype={weights_dtype!r} is not supported; use one of: "
                              f"{', '.join(WEIGHTS_DTYPES)}")
        if weights_dtype in ("q8_0", "q4_0") and device.type not in ("cpu", "cuda"):
            raise ConfigError(f"weights_dtype={weights_dtype!r} runs on the CPU (our block-format C kernels) or on "
                              f"CUDA (torchao), not on {device.type}; use weights_dtype='auto', 'float32' or "
                              "'bfloat16' there")
        if cuda_weights.uses_torchao(weights_dtype, device):
            cuda_weights.check_cuda_weights(weights_dtype, device)
        self.tensors = checkpoint.tensors
        self.keep_blocks = weights_dtype == "auto" and device.type == "cpu" and isinstance(self.tensors, GGUFCheckpoint)
        # On CUDA the matrices come dense and torchao quantizes each layer once it is on the device.
        self.quantize_to = weights_dtype.upper() if weights_dtype in ("q8_0", "q4_0") and device.type == "cpu" \
            else None

    def _is_matrix(self, name: str) -> bool:
        return name.endswith(".weight") and "norm" not in name

    def __getitem__(self, name: str) -> torch.Tensor | QuantizedTensor:
        if self.keep_blocks and self._is_matrix(name):
            blocks = self.tensors.blocks(name)
            if blocks is not None:
                return blocks
        value = self.tensors[name]
        if self.quantize_to and value.dim() == 2 and value.shape[1] % BLOCK_FORMATS[self.quantize_to][0] == 0:
            return quantize(value, self.quantize_to)
        return value

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


def weights_bytes(checkpoint: Checkpoint, weights_dtype: str, dtype: torch.dtype,
                  device: torch.device = torch.device("cpu")) -> int:
    """Bytes the model's weights will take once loaded (block formats at their size), before loading them."""
    if cuda_weights.uses_torchao(weights_dtype, device):
        return cuda_weights.torchao_weights_bytes(checkpoint.config, weights_dtype, dtype)
    dense_dtype = _DENSE.get(weights_dtype, dtype)
    dense = checkpoint.config.num_parameters() * torch.empty((), dtype=dense_dtype).element_size()
    if weights_dtype in ("q8_0", "q4_0"):
        return dense * BLOCK_FORMATS[weights_dtype.upper()][1] // (32 * torch.empty((), dtype=dense_dtype).element_size())
    tensors = checkpoint.tensors
    if weights_dtype != "auto" or not isinstance(tensors, GGUFCheckpoint):
        return dense
    return tensors.stored_bytes_as_kept(torch.empty((), dtype=dtype).element_size())


def build_model(checkpoint: Checkpoint, device: torch.device, dtype: torch.dtype,
                weights_dtype: str = "auto", decode_activations: str = "auto") -> LlamaModel:
    """Instantiate our decoder and load the checkpoint's tensors into it (tqdm bar on a terminal)."""
    stored = StoredWeights(checkpoint, weights_dtype, device)
    decoder = DECODER_FAMILIES[BY_HF_NAME[checkpoint.config.architecture].family]
    torchao = cuda_weights.uses_torchao(weights_dtype, device)
    # torchao's int4 kernel takes bfloat16 weights only; int8 keeps the same dtype for its scales' products.
    dense_dtype = torch.bfloat16 if torchao else _DENSE.get(weights_dtype)
    model = decoder(checkpoint.config, device=device, dtype=dtype, weights_dtype=dense_dtype,
                    decode_activations=decode_activations)
    finish_layer = (lambda layer: cuda_weights.quantize_layer(layer, weights_dtype)) if torchao else None
    model.load_hf_state_dict(stored, progress=sys.stderr.isatty(), finish_layer=finish_layer)
    label = weights_label(weights_dtype, device, model.workspace.activations)
    logger.info("weights: %s, %.1f MiB as stored", label, model.num_parameter_bytes() / 2**20)
    return model


def weights_label(weights_dtype: str, device: torch.device, activations: str) -> str:
    """How a model's weights compute, in the words fingerprints keep (the KV of a prompt decoded
    under another label is other KV): weights_dtype, then " (torchao)" for CUDA's int8/int4
    weights, " (int8 activations)" / " (int8 activations by format)" where the CPU's block-format
    GEMV rounds x to 8 bits for every format / by quant_kernels.int8_for."""
    if cuda_weights.uses_torchao(weights_dtype, device):
        return f"{weights_dtype} (torchao)"
    if activations != "float32" and device.type == "cpu" and weights_dtype in ("auto", "q8_0", "q4_0"):
        return f"{weights_dtype} (int8 activations{' by format' if activations == 'auto' else ''})"
    return weights_dtype
