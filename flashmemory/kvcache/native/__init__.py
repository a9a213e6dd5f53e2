"""The native kernels (C sources in csrc/, built and loaded by loader.py): decode attention over block records,
the heat predictor's MLP and its per-step access statistics. Optional: without a C compiler (or with
FLASHMEMORY_NATIVE=0) every caller runs its pure-torch path."""

from flashmemory.kvcache.native.decode import DecodeState, RecordFormat, supports
from flashmemory.kvcache.native.loader import (
    MAX_BLOCK_TOKENS,
    MAX_GROUP,
    MAX_HEAD_DIM,
    MLP_MAX_FEATURES,
    MLP_MAX_HIDDEN,
    library,
)

__all__ = ["MAX_BLOCK_TOKENS", "MAX_GROUP", "MAX_HEAD_DIM", "MLP_MAX_FEATURES", "MLP_MAX_HIDDEN", "DecodeState",
           "RecordFormat", "library", "supports"]
