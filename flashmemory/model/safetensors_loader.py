"""Read a Hugging Face safetensors folder (config.json + one or many shards), checking every shard is whole."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from flashmemory.errors import CorruptWeightsError, ModelNotFoundError
from flashmemory.model.model_config import ModelConfig

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class _TensorEntry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    num_bytes: int


def check_safetensors_file(path: Path) -> dict[str, _TensorEntry]:
    """Validate a shard's header against its size; return where each tensor lies. Raises CorruptWeightsError."""
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
    out = {}
    for name, v in entries.items():
        if v.get("dtype") not in _DTYPES:
            raise CorruptWeightsError(f"{path}: tensor {name} has unsupported dtype {v.get('dtype')!r}")
        begin, end = (int(x) for x in v["data_offsets"])
        out[name] = _TensorEntry(path, _DTYPES[v["dtype"]], tuple(int(d) for d in v["shape"]), 8 + header_len + begin,
                                 end - begin)
    return out


class SafetensorsCheckpoint(Mapping[str, torch.Tensor]):
    """Maps the tensor names of a safetensors folder to tensors, each read from disk on demand.

    Plain reads rather than a memory map: mapped pages would count in the process's RSS on top of the
    model's own copy of the weights, doubling peak memory while loading.
    """

    def __init__(self, folder: Path) -> None:
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
        self._where: dict[str, _TensorEntry] = {}
        for shard in shards:
            self._where.update(check_safetensors_file(shard))

    def __getitem__(self, name: str) -> torch.Tensor:
        entry = self._where[name]
        buf = bytearray(entry.num_bytes)
        with entry.file.open("rb") as f:
            f.seek(entry.start)
            if f.readinto(buf) != entry.num_bytes:
                raise CorruptWeightsError(f"{entry.file} ended while reading tensor {name}; download it again")
        if entry.num_bytes == 0:
            return torch.empty(entry.shape, dtype=entry.dtype)
        return torch.frombuffer(buf, dtype=entry.dtype).reshape(entry.shape)

    def __contains__(self, name: object) -> bool:  # Mapping's default would read the tensor
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)
