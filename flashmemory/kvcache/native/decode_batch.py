"""Decode attention of a whole batch in one native call (csrc/decode_batch.c): each sequence's key
sets (dense rows, a pool's block records) are packed into one table of int64 fields and folded with
the work of every sequence, KV head and block chunk dealt to the threads together. A sequence's
output is the same bits as DecodeState's calls over the same key sets in the same order
(decode.py), whatever else is in the batch."""

from __future__ import annotations

import ctypes
from array import array

import torch

from flashmemory.kvcache.native.decode import RecordFormat

# fm_source in csrc/decode_batch.c, field by field
SOURCE_FIELDS = ("kind", "k", "v", "m", "head_stride", "row_stride", "storage", "num_slots",
                 "record_bytes", "slots", "slot_stride", "table", "n", "bits", "bs", "kgroup",
                 "vgroup", "codes_off", "ks_off", "kz_off", "vs_off", "vz_off")
DENSE, DENSE_F16, RECORDS = 0, 1, 2  # FM_SOURCE_*
_NO_DENSE = (0,) * 5  # k, v, m, head_stride, row_stride of a records source
_NO_RECORDS = (0,) * 16  # storage .. vz_off of a dense source


class DecodeBatchCall:
    """Collects the key sets of a batch's decode queries, sequence by sequence, for one call."""

    def __init__(self, lib: ctypes.CDLL, num_kv_heads: int) -> None:
        self.lib = lib
        self.heads = num_kv_heads
        self.fields: list[int] = []  # len(SOURCE_FIELDS) per key set
        self.starts: list[int] = [0]  # key sets of sequence b: starts[b] .. starts[b + 1]
        # Every tensor whose memory the call reads: alive until it returns, even the ones a caller
        # made for one key set only (e.g. a file level's records)
        self.keep: list[torch.Tensor] = []

    def next_sequence(self) -> None:
        """The key sets added from now on belong to the next sequence (the batch's next query)."""
        self.starts.append(self.starts[-1])

    def _add(self, fields: tuple[int, ...]) -> None:
        self.fields.extend(fields)
        self.starts[-1] += 1

    def add_dense(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Float keys and values [heads, m, head_dim]; float16 ones with contiguous channels (any
        head and token strides, e.g. a view of the still-filling block) are read in place (as
        DecodeState.add_dense)."""
        if not k.shape[1]:
            return
        if k.dtype == v.dtype == torch.float16 and k.stride() == v.stride() and k.stride(2) == 1:
            self.keep += (k, v)
            self._add((DENSE_F16, k.data_ptr(), v.data_ptr(), k.shape[1], k.stride(0), k.stride(1))
                      + _NO_RECORDS)
            return
        k = k.to(torch.float32).contiguous()
        v = v.to(torch.float32).contiguous()
        self.keep += (k, v)
        self._add((DENSE, k.data_ptr(), v.data_ptr(), k.shape[1], 0, 0) + _NO_RECORDS)

    def add_records(self, storage: torch.Tensor, slots: torch.Tensor, fmt: RecordFormat,
                    table: torch.Tensor | None = None, layer: int | None = None) -> None:
        """Blocks of one layer's pool storage [heads, num_slots, record_bytes] (or, with `layer`,
        of that layer of a whole pool's storage); slots [heads, n] int64, looked up in `table`
        when given (as DecodeState.add_records)."""
        if slots.stride(1) != 1 or slots.stride(0) not in (0, slots.shape[1]):
            slots = slots.contiguous()
        self.keep += (storage, slots) if table is None else (storage, slots, table)
        assert storage.is_contiguous() and slots.dtype == torch.int64
        assert slots.shape[0] == self.heads
        base = storage.data_ptr()
        if layer is not None:
            base += layer * storage.stride(0) * storage.element_size()
        if table is not None:
            assert table.dtype == torch.int64 and table.is_contiguous()
        self._add((RECORDS,) + _NO_DENSE + (
            base, storage.shape[-2], storage.shape[-1], slots.data_ptr(), slots.stride(0),
            0 if table is None else table.data_ptr(), slots.shape[1], fmt.bits, fmt.block_size,
            fmt.key_group_tokens, fmt.value_group_channels, fmt.codes_offset, fmt.k_scale_offset,
            fmt.k_zero_offset, fmt.v_scale_offset, fmt.v_zero_offset))

    def attend(self, q: torch.Tensor) -> torch.Tensor:
        """The attention [B, num_heads, head_dim] of q [B, num_heads, head_dim] (float32, CPU;
        B = the sequences added) over each sequence's key sets."""
        batch, num_heads, head_dim = q.shape
        assert q.dtype == torch.float32 and batch == len(self.starts) - 1
        q = q.contiguous()
        # int64 arrays: a few microseconds less per layer than tensors made from the lists
        sources, starts = array("q", self.fields), array("q", self.starts)
        out = torch.empty((batch, num_heads, head_dim), dtype=torch.float32)
        group = num_heads // self.heads
        rc = self.lib.fm_attend_batch(q.data_ptr(), head_dim**-0.5, batch, self.heads, group,
                                      head_dim, sources.buffer_info()[0], starts.buffer_info()[0],
                                      torch.get_num_threads(), out.data_ptr())
        if rc == -2:
            raise MemoryError("no memory for the decode kernel's scratch states")
        if rc != 0:
            raise ValueError(f"a key set of this batch (head_dim {head_dim}, {group} query heads "
                             "per KV head) is outside the decode kernel's limits")
        return out
