"""A lean GGUF reader: header, metadata (large token arrays skipped) and tensor locations; data memory-mapped.

gguf's own GGUFReader builds a numpy view per array element (100K tokenizer strings: ~5 s); we only need the
model hyper-parameters and where each tensor lies. The arithmetic of dequantization stays with `gguf.quants`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_KEEP_ARRAYS_UP_TO = 64  # longer arrays (tokens, merges, scores) are skipped, not decoded


class GGUFFormatError(ValueError):
    """The bytes are not a GGUF file we can read (bad magic, version, or a record past the end)."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # GGML order: innermost dimension first
    type_id: int
    offset: int  # absolute byte offset of the data in the file
    num_bytes: int


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise GGUFFormatError("unexpected end of file in the GGUF header")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise GGUFFormatError("unexpected end of file in a GGUF string")
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        length = self.take("<Q")  # read first: `self.pos += self.take(...)` would use the old position
        self.pos += length

    def value(self, type_id: int) -> Any:
        if type_id in _SCALARS:
            return self.take(_SCALARS[type_id])
        if type_id == _STRING:
            return self.string()
        if type_id == _ARRAY:
            return self.array()[1]
        raise GGUFFormatError(f"unknown GGUF value type {type_id}")

    def array(self) -> tuple[int, list[Any] | None]:
        """(element count, elements); elements are None when the array is too long to decode."""
        item_type, count = self.take("<I"), self.take("<Q")
        if count <= _KEEP_ARRAYS_UP_TO:
            return count, [self.value(item_type) for _ in range(count)]
        if item_type in _SCALARS:
            self.pos += count * struct.calcsize(_SCALARS[item_type])
        elif item_type == _STRING:
            for _ in range(count):
                self.skip_string()
        else:
            for _ in range(count):
                self.value(item_type)
        return count, None  # skipped: too long to matter for the model's hyper-parameters


class GGUFFile:
    """Owns a memory map of one GGUF file: its metadata and the location of every tensor."""

    def __init__(self, path: Path) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = path
        self._map = np.memmap(path, dtype=np.uint8, mode="r")
        cur = _Cursor(memoryview(self._map))
        if bytes(cur.buf[:4]) != GGUF_MAGIC:
            raise GGUFFormatError("missing GGUF magic bytes")
        cur.pos = 4
        version = cur.take("<I")
        if version not in (2, 3):
            raise GGUFFormatError(f"GGUF version {version} is not supported (2 or 3)")
        num_tensors, num_kv = cur.take("<Q"), cur.take("<Q")
        self.metadata: dict[str, Any] = {}
        # NOTE: the header states an array's length even where we skip its contents; llama.cpp takes the
        # vocabulary size from the length of tokenizer.ggml.tokens, so every array's length is kept.
        self.array_lengths: dict[str, int] = {}
        for _ in range(num_kv):
            key = cur.string()
            type_id = cur.take("<I")
            if type_id == _ARRAY:
                self.array_lengths[key], value = cur.array()
            else:
                value = cur.value(type_id)
            if value is not None:
                self.metadata[key] = value
        infos = []
        for _ in range(num_tensors):
            name = cur.string()
            dims = tuple(cur.take("<Q") for _ in range(cur.take("<I")))
            type_id, offset = cur.take("<I"), cur.take("<Q")
            infos.append((name, dims, type_id, offset))
        alignment = int(self.metadata.get("general.alignment", 32))
        data_start = -(-cur.pos // alignment) * alignment
        self.tensors: list[GGUFTensorInfo] = []
        for name, dims, type_id, offset in infos:
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
            except (ValueError, KeyError):
                raise GGUFFormatError(f"tensor {name} has unknown GGML type {type_id}") from None
            n = int(np.prod(dims)) if dims else 1
            self.tensors.append(GGUFTensorInfo(name, dims, type_id, data_start + offset, n // block * type_size))

    def raw(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor's bytes as [rows, bytes per row] uint8, read into a fresh array (not a view of the map).
        Read, not mapped: a mapped tensor's pages stay resident (and count in this process's RSS) as long as the
        map lives, so loading a model would hold the whole file beside the weights built from it."""
        data = np.empty(info.num_bytes, dtype=np.uint8)
        with self.path.open("rb") as f:
            f.seek(info.offset)
            if f.readinto(memoryview(data)) != info.num_bytes:
                raise GGUFFormatError(f"tensor {info.name} runs past the end of {self.path} (a truncated file?)")
        rows = int(np.prod(info.shape[1:])) if len(info.shape) > 1 else 1
        return data.reshape(rows, -1)
