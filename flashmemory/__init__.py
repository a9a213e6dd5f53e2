"""FlashMemory: long-context LLM inference with the KV cache as a memory hierarchy."""

from flashmemory.config import EngineConfig
from flashmemory.engine.engine import FlashMemoryEngine
from flashmemory.engine.sampling import SamplingParams
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
