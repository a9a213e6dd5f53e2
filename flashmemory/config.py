"""EngineConfig: every engine setting, with units in the names, validated with the fix in the message."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any

import torch

from flashmemory.errors import ConfigError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}


@dataclass
class EngineConfig:
    """Settings of one FlashMemoryEngine."""

    model_path: str | None = None  # GGUF file or HF safetensors folder; None = embedded SmolLM2-135M-Instruct
    device: str = "auto"  # "auto" (CUDA when present, else CPU), "cpu", "cuda", "cuda:N"
    dtype: str = "auto"  # "auto" (float32 on CPU, bfloat16 on CUDA when supported), "float32", "bfloat16", "float16"
    max_seq_len: int | None = None  # longest sequence (prompt + generated) in tokens; None = the model's limit
    num_threads: int | None = None  # torch intra-op threads on CPU; None = torch's default

    def __post_init__(self) -> None:
        if self.dtype in _DTYPE_ALIASES:
            self.dtype = _DTYPE_ALIASES[self.dtype]
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ConfigError(f"dtype={self.dtype!r} is not supported; use one of: auto, {', '.join(_DTYPES)}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(f"device={self.device!r} is not supported; use auto, cpu, cuda or cuda:N")
        if self.max_seq_len is not None and (not isinstance(self.max_seq_len, int) or self.max_seq_len < 2):
            raise ConfigError(f"max_seq_len={self.max_seq_len!r} must be an integer >= 2 (tokens), or None")
        if self.num_threads is not None and (not isinstance(self.num_threads, int) or self.num_threads < 1):
            raise ConfigError(f"num_threads={self.num_threads!r} must be a positive integer, or None")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """Build from keyword arguments; an unknown one raises ConfigError listing the valid names."""
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(kwargs) - set(valid))
        if unknown:
            raise ConfigError(f"unknown engine setting(s) {', '.join(unknown)}; valid settings: {', '.join(valid)}")
        return cls(**kwargs)

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"device={self.device!r} but CUDA is not available on this machine; use device='cpu'")
        return torch.device(self.device)

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)
