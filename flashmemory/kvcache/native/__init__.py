"""The native kernels (C sources in csrc/, built and loaded by loader.py): decode attention over
block records (one sequence, or a whole batch in one call), Quest's block selection and the
two-pass read's key scores, the heat
predictor's MLP and its per-step access statistics, the KV codec's range choice and the disk
level's batched segment reads. Optional: without a C compiler (or with FLASHMEMORY_NATIVE=0) every
caller runs its pure-torch path."""

from flashmemory.kvcache.native.decode import DecodeState, RecordFormat, supports
from flashmemory.kvcache.native.decode_batch import DecodeBatchCall
from flashmemory.kvcache.native.segment_read import use_native_reads
from flashmemory.kvcache.native.rescore import NativeRescore, native_rescore
from flashmemory.kvcache.native.selection import NativeSelection, native_selection
from flashmemory.kvcache.native.loader import (
    MAX_BLOCK_TOKENS,
    MAX_GROUP,
    MAX_HEAD_DIM,
    MLP_MAX_FEATURES,
    MLP_MAX_HIDDEN,
    library,
)

__all__ = ["MAX_BLOCK_TOKENS", "MAX_GROUP", "MAX_HEAD_DIM", "MLP_MAX_FEATURES", "MLP_MAX_HIDDEN",
           "DecodeBatchCall", "DecodeState",
           "NativeRescore", "NativeSelection", "RecordFormat", "library", "native_rescore",
           "native_selection", "supports",
           "use_native_reads"]
