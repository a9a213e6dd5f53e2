"""FlashMemory: long-context LLM inference with the KV cache as a memory hierarchy."""

from typing import TYPE_CHECKING, Any

from flashmemory.errors import (
    ConfigError,
    CorruptWeightsError,
    FlashMemoryError,
    ModelNotFoundError,
    PromptTooLongError,
    SamplingParamsError,
    UnsupportedModelError,
)
from flashmemory.version import __version__

if TYPE_CHECKING:
    from flashmemory.config import EngineConfig
    from flashmemory.engine.engine import FlashMemoryEngine
    from flashmemory.engine.sampling import SamplingParams

# The engine's names load torch; they are imported on first use, so a process that only needs a light part of the
# package (the benchmark's llama.cpp worker, whose peak RSS must be llama.cpp's own) never pays for torch.
_LAZY = {"EngineConfig": "flashmemory.config", "FlashMemoryEngine": "flashmemory.engine.engine",
         "SamplingParams": "flashmemory.engine.sampling"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'flashmemory' has no attribute {name!r}")


__all__ = [
    "ConfigError",
    "CorruptWeightsError",
    "EngineConfig",
    "FlashMemoryEngine",
    "FlashMemoryError",
    "ModelNotFoundError",
    "PromptTooLongError",
    "SamplingParams",
    "SamplingParamsError",
    "UnsupportedModelError",
    "__version__",
]
