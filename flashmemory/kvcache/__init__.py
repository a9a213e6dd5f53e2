"""KV cache: the interface attention reaches keys and values through, and its implementations."""

from flashmemory.kvcache.interface import ForwardBatch, KVCache, SequenceSlice

__all__ = ["ForwardBatch", "KVCache", "SequenceSlice"]
