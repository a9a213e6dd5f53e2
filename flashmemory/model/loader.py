"""Open a checkpoint (GGUF file or safetensors folder, default: the embedded model) and build our decoder from it."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from flashmemory.errors import ModelNotFoundError
from flashmemory.model.default_model import default_model_path
from flashmemory.model.gguf_loader import GGUFCheckpoint
from flashmemory.model.llama import LlamaModel
from flashmemory.model.model_config import ModelConfig
from flashmemory.model.registry import BY_HF_NAME
from flashmemory.model.safetensors_loader import SafetensorsCheckpoint

logger = logging.getLogger(__name__)

# registry.Architecture.family -> the decoder class that builds it.
DECODER_FAMILIES: dict[str, type[LlamaModel]] = {"llama": LlamaModel}


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
    if not path.exists():
        raise ModelNotFoundError(
            f"model path {str(path)!r} does not exist; pass a GGUF file or a Hugging Face folder "
            "(config.json + *.safetensors), or omit it to use the embedded SmolLM2"
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


def build_model(checkpoint: Checkpoint, device: torch.device, dtype: torch.dtype) -> LlamaModel:
    """Instantiate our decoder and load the checkpoint's tensors into it (tqdm bar on a terminal)."""
    decoder = DECODER_FAMILIES[BY_HF_NAME[checkpoint.config.architecture].family]
    model = decoder(checkpoint.config, device=device, dtype=dtype)
    model.load_hf_state_dict(checkpoint.tensors, progress=sys.stderr.isatty())
    return model
