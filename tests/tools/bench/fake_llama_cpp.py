"""A stand-in for the `llama_cpp` module (llama-cpp-python), enough to drive the bench's llama.cpp adapter.

Its "model" is deterministic: the logits after a token favour token (t * 7 + position) % vocab, and a quantized
KV type adds a small, reproducible perturbation (so fidelity against f16 is measurably imperfect). Like
llama.cpp, it refuses a quantized V cache without flash attention and rounds n_ctx up to 256 cells.
"""

from __future__ import annotations

import ctypes

import numpy as np

GGML_TYPE_F16 = 1
GGML_TYPE_Q4_0 = 2
GGML_TYPE_Q8_0 = 8
VOCAB = 64

created: list["Llama"] = []  # every context made, for the tests to inspect


class ModelParams:
    """The model parameters llama-cpp-python's Llama() starts from (the field the bench sets)."""

    use_extra_bufts = True


def llama_model_default_params() -> ModelParams:
    return ModelParams()


class Llama:
    def __init__(self, model_path: str, n_ctx: int, n_batch: int, n_threads: int, n_threads_batch: int,
                 type_k: int, type_v: int, flash_attn: bool, logits_all: bool, verbose: bool) -> None:
        if type_v != GGML_TYPE_F16 and not flash_attn:
            raise ValueError("Failed to create llama_context")
        self.model_path = model_path
        self.use_extra_bufts = llama_model_default_params().use_extra_bufts  # as Llama() reads them
        self._n_ctx = -(-n_ctx // 256) * 256
        self.n_threads = n_threads
        self.type_k, self.type_v = type_k, type_v
        self.n_tokens = 0
        self.evaluated: list[int] = []
        self._logits = (ctypes.c_float * VOCAB)()
        self.ctx = self  # llama_get_logits_ith receives it back
        self.metadata = {"general.architecture": "llama", "llama.block_count": "2", "llama.embedding_length": "64",
                         "llama.attention.head_count": "4", "llama.attention.head_count_kv": "2"}
        self.closed = False
        created.append(self)

    def n_vocab(self) -> int:
        return VOCAB

    def n_ctx(self) -> int:
        return self._n_ctx

    def reset(self) -> None:
        self.n_tokens = 0

    def eval(self, tokens: list[int]) -> None:
        if self.n_tokens + len(tokens) > self._n_ctx:
            raise RuntimeError("context full")
        self.evaluated = self.evaluated[: self.n_tokens] + list(tokens)
        self.n_tokens += len(tokens)
        favoured = (tokens[-1] * 7 + self.n_tokens) % VOCAB
        logits = np.zeros(VOCAB, dtype=np.float32)
        logits[favoured] = 4.0
        if self.type_k != GGML_TYPE_F16:
            logits += np.float32(0.5) * np.sin(np.arange(VOCAB, dtype=np.float32) * (self.n_tokens % 5 + 1))
        ctypes.memmove(self._logits, logits.ctypes.data, VOCAB * 4)

    def close(self) -> None:
        self.closed = True


def llama_get_logits_ith(ctx: Llama, i: int):
    assert i == -1
    return ctypes.cast(ctx._logits, ctypes.POINTER(ctypes.c_float))
