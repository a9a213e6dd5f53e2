"""EngineConfig: every engine setting, with units in the names, validated with the fix in the message."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any

import torch

from flashmemory.errors import ConfigError

# float64 is for numerical verification (exactness tests), not for serving.
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}


@dataclass
class EngineConfig:
    """Settings of one FlashMemoryEngine."""

    model_path: str | None = None  # GGUF file or HF safetensors folder; None = embedded SmolLM2-135M-Instruct
    device: str = "auto"  # "auto" (CUDA when present, else CPU), "cpu", "cuda", "cuda:N"
    dtype: str = "auto"  # "auto" (float32 on CPU, bfloat16 on CUDA when supported), "float32", "bfloat16", "float16"
    max_seq_len: int | None = None  # longest sequence (prompt + generated) in tokens; None = the model's limit
    num_threads: int | None = None  # torch intra-op threads on CPU; None = torch's default
    # ---- KV hierarchy (DESIGN.md section 2) ----
    kv_cache: str = "tiered"  # "tiered" (L0/L1/L2 hierarchy) or "contiguous" (exact baseline, one tensor per sequence)
    kv_precision: str = "mixed"  # "mixed" (INT4 L0 / FP16 L1 / INT2 L2), "int4" (INT4 L0 and L2), "fp16" (none)
    max_gpu_memory_mb: int | None = None  # device budget for weights + workspace + L0 KV; None = size L0 for max_num_seqs
    active_window: int = 2048  # newest tokens kept in L0
    warm_tokens: int = 16384  # tokens after the window kept in L1 (host) before moving to L2 (disk)
    semantic_truncate_threshold: float = 0.15  # fraction of L2 blocks a decode step attends (query-aware)
    warm_budget_tokens: int = 2048  # tokens of L1 blocks a decode step attends (query-aware)
    cpu_memory_gb: float = 4.0  # L1 host pool capacity
    cold_zone_enabled: bool = True  # False keeps all older KV in L1 (and says so when L1 is full)
    cold_zone_dir: str | None = None  # folder of the L2 file; None = a private temporary folder
    cold_zone_gb: float = 16.0  # L2 file capacity (sparse: disk is used only as blocks are written)
    block_size: int | str = 16  # tokens per KV block, or "auto" (by max_seq_len)
    prefill_chunk_tokens: int = 512  # prompt tokens per forward during prefill (bounds activation memory)
    selection: str = "quest"  # "quest" (attend the blocks the query needs) or "exact" (attend all)
    max_num_seqs: int = 4  # sequences alive at once (each holds a still-filling block in L0)
    record_traces: bool = False  # keep every decode step's block choices (per layer, KV head) for predictor training
    prefetch_strategy: str = "none"  # "none", "adaptive" (depth follows hit rate) or "aggressive" (L2 -> L1 staging)
    prefetch_ranker: str = "predictor"  # what ranks blocks to prefetch: "predictor" (heat MLP) or "lru" (recency)
    prefetch_budget_mb: float = 64.0  # host memory for prefetched L2 blocks (the staging area)
    heat_predictor_path: str | None = None  # trained heat-predictor weights (.npz); None = the shipped ones
    cold_zone_uncached_reads: bool = False  # drop L2 pages from the OS page cache after each read (honest disk I/O)
    # Device memory (counted in max_gpu_memory_mb) for L1 blocks the prefetcher copies ahead of the step that reads
    # them; 0 = off. For GPU hosts: on a CPU host L1 already is the compute's memory and staging only adds copies.
    device_staging_mb: float = 0.0

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
        self._validate_kv()

    def _validate_kv(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ConfigError(message)

        def positive_int(name: str) -> None:
            value = getattr(self, name)
            need(isinstance(value, int) and not isinstance(value, bool) and value > 0,
                 f"{name}={value!r} must be a positive integer")

        need(self.kv_cache in ("tiered", "contiguous"), f"kv_cache={self.kv_cache!r}: use 'tiered' or 'contiguous'")
        need(self.kv_precision in ("mixed", "int4", "fp16"),
             f"kv_precision={self.kv_precision!r}: use 'mixed', 'int4' or 'fp16'")
        need(self.selection in ("quest", "exact"), f"selection={self.selection!r}: use 'quest' or 'exact'")
        for name in ("active_window", "warm_budget_tokens", "prefill_chunk_tokens", "max_num_seqs"):
            positive_int(name)
        need(isinstance(self.warm_tokens, int) and self.warm_tokens >= 0, f"warm_tokens={self.warm_tokens!r} must be >= 0")
        need(self.max_gpu_memory_mb is None or (isinstance(self.max_gpu_memory_mb, int) and self.max_gpu_memory_mb > 0),
             f"max_gpu_memory_mb={self.max_gpu_memory_mb!r} must be a positive integer (MiB) or None")
        need(isinstance(self.semantic_truncate_threshold, (int, float)) and 0 < self.semantic_truncate_threshold <= 1,
             f"semantic_truncate_threshold={self.semantic_truncate_threshold!r} must be in (0, 1]")
        for name in ("cpu_memory_gb", "cold_zone_gb"):
            value = getattr(self, name)
            need(isinstance(value, (int, float)) and value > 0, f"{name}={value!r} must be a positive number (GiB)")
        need(self.prefetch_strategy in ("none", "adaptive", "aggressive"),
             f"prefetch_strategy={self.prefetch_strategy!r}: use 'none', 'adaptive' or 'aggressive'")
        need(self.prefetch_ranker in ("predictor", "lru"),
             f"prefetch_ranker={self.prefetch_ranker!r}: use 'predictor' or 'lru'")
        need(isinstance(self.prefetch_budget_mb, (int, float)) and self.prefetch_budget_mb > 0,
             f"prefetch_budget_mb={self.prefetch_budget_mb!r} must be a positive number (MiB)")
        need(isinstance(self.device_staging_mb, (int, float)) and self.device_staging_mb >= 0,
             f"device_staging_mb={self.device_staging_mb!r} must be a number >= 0 (MiB; 0 = off)")
        need(self.device_staging_mb == 0 or self.prefetch_strategy != "none",
             f"device_staging_mb={self.device_staging_mb} needs a prefetcher to fill it: set prefetch_strategy to "
             "'adaptive' or 'aggressive', or device_staging_mb=0")
        bs = self.block_size
        need(bs == "auto" or (isinstance(bs, int) and bs in (8, 16, 32, 64, 128)),
             f"block_size={bs!r}: use 'auto' or one of 8, 16, 32, 64, 128 (tokens)")
        if isinstance(bs, int):
            need(self.active_window >= bs, f"active_window={self.active_window} must be at least block_size={bs}")

    @staticmethod
    def kv_field_names() -> list[str]:
        """The KV-hierarchy settings (everything reconfigure_kv may change)."""
        names = [f.name for f in fields(EngineConfig)]
        return names[names.index("kv_cache"):]

    def resolve_block_size(self, max_seq_len: int) -> int:
        """Tokens per block; "auto" keeps block tables short for long contexts."""
        if self.block_size != "auto":
            return int(self.block_size)
        return 16 if max_seq_len <= 8192 else 32 if max_seq_len <= 32768 else 64

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
