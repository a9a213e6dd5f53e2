"""Decode attention through the native kernel: an online-softmax state that folds dense keys/values and block
records read straight from a KV pool's storage (INT4 / INT2 / FP16), so a decode step never writes a float copy of
the quantized window (the torch path's main cost on a CPU)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flashmemory.kvcache.native.loader import MAX_BLOCK_TOKENS, MAX_HEAD_DIM, library
from flashmemory.kvcache.quant import Codec


@dataclass(frozen=True)
class RecordFormat:
    """Where a pool's block record keeps its parts (byte offsets) and how they are coded."""

    bits: int
    block_size: int
    key_group_tokens: int
    value_group_channels: int
    codes_offset: int  # "codes" (INT) or "kv" (FP16)
    k_scale_offset: int = 0
    k_zero_offset: int = 0
    v_scale_offset: int = 0
    v_zero_offset: int = 0

    @classmethod
    def of(cls, codec: Codec, block_size: int, offset_of: Callable[[str], int]) -> "RecordFormat":
        """The format of records coded by `codec`, with each part at `offset_of(part)` bytes."""
        if codec.bits == 16:
            return cls(16, block_size, codec.key_group_tokens, codec.value_group_channels, offset_of("kv"))
        return cls(codec.bits, block_size, codec.key_group_tokens, codec.value_group_channels, offset_of("codes"),
                   offset_of("k_scale"), offset_of("k_zero"), offset_of("v_scale"), offset_of("v_zero"))

    @classmethod
    def for_pool(cls, pool) -> "RecordFormat":
        """The format of a memory pool's records (anything with `codec`, `block_size` and `offset_of`)."""
        return cls.of(pool.codec, pool.block_size, pool.offset_of)


class DecodeState:
    """Online-softmax state of one decode query over any number of key sets: [heads, group, head_dim + 2].

    One state serves every layer of a step (`reset` per layer): its buffers are allocated once."""

    def __init__(self, lib: ctypes.CDLL, q: torch.Tensor, num_kv_heads: int) -> None:
        # q: [num_heads, head_dim] float32 on the CPU (one token)
        num_heads, head_dim = q.shape
        self.lib = lib
        self.heads, self.group, self.dim = num_kv_heads, num_heads // num_kv_heads, head_dim
        self.q = torch.empty((num_heads, head_dim), dtype=torch.float32)
        self.state = torch.empty((num_kv_heads, self.group, head_dim + 2), dtype=torch.float32)
        self._q_ptr, self._state_ptr = self.q.data_ptr(), self.state.data_ptr()
        self.reset(q)

    def reset(self, q: torch.Tensor) -> None:
        """Start over with query q [num_heads, head_dim] (float32, CPU): nothing folded in."""
        q = q.contiguous()
        assert q.dtype == torch.float32 and q.shape == self.q.shape
        self.lib.fm_decode_begin(q.data_ptr(), self.dim**-0.5, self.heads * self.group, self.dim, self._q_ptr,
                                 self._state_ptr)

    def add_records(self, storage: torch.Tensor, slots: torch.Tensor, fmt: RecordFormat,
                    table: torch.Tensor | None = None, layer: int | None = None) -> None:
        """Fold blocks of one layer's pool storage [heads, num_slots, record_bytes] (or, with `layer`, of that layer
        of a whole pool's storage [layers, heads, num_slots, record_bytes]). slots [heads, n] int64: block i of head
        h is slot slots[h, i], or table[slots[h, i]] when a table [num_positions] int64 is given; an expanded row
        (head stride 0: every head the same blocks) is read in place."""
        if slots.stride(1) != 1 or slots.stride(0) not in (0, slots.shape[1]):
            slots = slots.contiguous()
        assert storage.is_contiguous() and slots.dtype == torch.int64 and slots.shape[0] == self.heads
        base = storage.data_ptr()
        if layer is not None:
            base += layer * storage.stride(0) * storage.element_size()
        if table is not None:
            assert table.dtype == torch.int64 and table.is_contiguous()
        rc = self.lib.fm_attend_records(
            self._q_ptr, self.heads, self.group, self.dim, base, storage.shape[-2], storage.shape[-1],
            slots.data_ptr(), slots.stride(0), None if table is None else table.data_ptr(), slots.shape[1], fmt.bits,
            fmt.block_size, fmt.key_group_tokens, fmt.value_group_channels, fmt.codes_offset, fmt.k_scale_offset,
            fmt.k_zero_offset, fmt.v_scale_offset, fmt.v_zero_offset, self._state_ptr, torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"block format {fmt} is outside the decode kernel's limits")

    def add_dense(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Fold float keys and values [heads, m, head_dim]; float16 ones with contiguous channels (any head and
        token strides, e.g. a view of the still-filling block) are read in place."""
        if not k.shape[1]:
            return
        if (k.dtype == v.dtype == torch.float16 and k.stride() == v.stride() and k.stride(2) == 1):
            rc = self.lib.fm_attend_dense_f16(self._q_ptr, self.heads, self.group, self.dim, k.data_ptr(),
                                              v.data_ptr(), k.shape[1], k.stride(0), k.stride(1), self._state_ptr)
        else:
            k = k.to(torch.float32).contiguous()
            v = v.to(torch.float32).contiguous()
            rc = self.lib.fm_attend_dense(self._q_ptr, self.heads, self.group, self.dim, k.data_ptr(),
                                          v.data_ptr(), k.shape[1], self._state_ptr)
        if rc != 0:
            raise ValueError(f"head_dim {self.dim} / group {self.group} are outside the decode kernel's limits")

    def output(self) -> torch.Tensor:
        """[num_heads, head_dim]: the attention over everything folded in (a new tensor)."""
        out = torch.empty((self.heads * self.group, self.dim), dtype=torch.float32)
        self.lib.fm_decode_end(self._state_ptr, self.heads * self.group, self.dim, out.data_ptr())
        return out


def supports(block_size: int, head_dim: int, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether decode steps of this geometry can use the kernel (CPU, float32 compute, within its limits; the
    query group is checked per call, `MAX_GROUP`)."""
    return (device.type == "cpu" and dtype == torch.float32 and block_size <= MAX_BLOCK_TOKENS
            and head_dim <= MAX_HEAD_DIM and head_dim % 8 == 0 and library() is not None)
