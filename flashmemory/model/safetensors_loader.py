"""Read a Hugging Face safetensors folder (config.json + one or many shards), checking every shard is whole."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from flashmemory.errors import CorruptWeightsError, ModelNotFoundError
from flashmemory.model.model_config import ModelConfig


def check_safetensors_file(path: Path) -> list[str]:
    """Validate a shard's header against its size; return its tensor names. Raises CorruptWeightsError."""
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size:
                raise ValueError(f"header length {header_len} exceeds the file size")
            header = json.loads(f.read(header_len))
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise CorruptWeightsError(
            f"{path} is not a valid safetensors file ({e}); it may be truncated or corrupt — download it again"
        ) from e
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    data_end = max((int(v["data_offsets"][1]) for v in entries.values()), default=0)
    expected = 8 + header_len + data_end
    if size < expected:
        raise CorruptWeightsError(
            f"{path} is truncated: its header promises {expected} bytes, the file has {size}; download it again"
        )
    return list(entries)


class SafetensorsCheckpoint(Mapping[str, torch.Tensor]):
    """Owns the open shards of a safetensors folder; maps tensor names to tensors, read lazily."""

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        config_path = folder / "config.json"
        if not config_path.is_file():
            raise ModelNotFoundError(
                f"{folder} has no config.json; a Hugging Face model folder needs config.json and *.safetensors"
            )
        try:
            self.raw_config = json.loads(config_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CorruptWeightsError(f"{config_path} is not valid JSON ({e})") from e
        self.config = ModelConfig.from_hf_dict(self.raw_config)
        shards = sorted(folder.glob("*.safetensors"))
        if not shards:
            raise ModelNotFoundError(
                f"{folder} has no *.safetensors weights (PyTorch .bin checkpoints are not loaded: convert them "
                "with `save_pretrained(..., safe_serialization=True)`)"
            )
        self.path = folder
        self._handles = []
        self._where: dict[str, object] = {}
        for shard in shards:
            names = check_safetensors_file(shard)
            handle = safe_open(str(shard), framework="pt")
            self._handles.append(handle)
            for name in names:
                self._where[name] = handle

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)  # type: ignore[attr-defined]

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)
