"""A FlashMemory KV snapshot restored into llama.cpp: our per-layer post-RoPE FP16 keys and values written as the
sequence state `llama_state_seq_set_data` reads back (llama.cpp as bundled by llama-cpp-python 0.3.36), so a
long prompt prefilled once by our exact cache is decoded from by llama.cpp without its own prefill.

The state of one sequence, as that llama.cpp writes it (src/llama-context.cpp state_seq_get_data, then
src/llama-kv-cache.cpp state_write / state_write_meta / state_write_data), little endian:

    u32 magic 0xaf143cd8 | i32 seq_id | u32 n_stream | per stream: u32 cell_count, then (when cell_count > 0)
    per cell: i32 pos, u32 n_seq_id, i32 seq_id (no per-cell extension for qwen2 / llama: that is M-RoPE's) |
    u32 v_trans | u32 n_layer |
    per layer: i32 k_type, u64 k_row_bytes, cell_count rows of [num_kv_heads * head_dim] |
    per layer, v_trans = 0 (flash attention): i32 v_type, u64 v_row_bytes, cell_count rows as for K |
    per layer, v_trans = 1 (no flash attention): i32 v_type, u32 v_element_bytes, u32 n_embd_v_gqa, then for each
        of the n_embd_v_gqa channels its value in every cell.

A row is ggml_row_size(type, width) bytes: width f16 values, or width / 32 q8_0 blocks (ggml_rows.py). llama.cpp
refuses a quantized V cache without flash attention, so q8_0 V is never transposed; other types are refused.
A quantized cache holds rotated keys and values (src/llama-kv-cache.cpp attn_rot_k / attn_rot_v, applied in
src/llama-graph.cpp build_attn, unless LLAMA_ATTN_ROT_DISABLE is set): each head's K in chunks of nrot_k values
and its V in chunks of 64, multiplied by the orthonormal Walsh-Hadamard matrix of that size (ggml_gen_hadamard;
queries get the same rotation and the attention output V's inverse, so attention is unchanged). nrot_k is the
largest power of two from 64 up dividing head_dim; neither is rotated when head_dim is not a multiple of 64.

Keys carry over as they are for qwen2 (NEOX RoPE, our rotate-half layout); for llama llama.cpp's converter
permuted the q/k rows to interleaved pairs, so each key head is permuted the same way here. This module needs
numpy only: the llama.cpp bench worker never imports torch.
"""

from __future__ import annotations

import ctypes
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from flashmemory.errors import KVSnapshotError
from flashmemory.snapshot_format import read_header
from flashmemory.tools.bench.ggml_rows import (GGML_TYPE_F16, GGML_TYPE_Q8_0, Q8_0_BLOCK, QK8_0, ggml_type_of,
                                               quantize_q8_0, row_dtype)

STATE_MAGIC = 0xAF143CD8  # io_magic in llama-context.cpp
# Architectures whose cached keys we can write: True where llama.cpp's converter permuted q/k to interleaved pairs.
ROPE_INTERLEAVED = {"qwen2": False, "llama": True}


@dataclass
class SequenceState:
    """One sequence's KV as llama.cpp's state holds it: cell positions and per-layer keys and values."""

    positions: np.ndarray  # [num_cells] int32
    # [num_layers, num_cells, row elements]: llama.cpp's K rows, num_kv_heads * head_dim float16 values (f16) or
    # a 32nd as many Q8_0 blocks (q8_0); the dtype names the ggml type (ggml_rows.py)
    keys: np.ndarray
    values: np.ndarray  # the same for V, one row per cell whatever v_trans
    v_trans: bool  # how llama.cpp stores V: transposed (no flash attention) or in rows
    seq_id: int = 0


def to_llama_rows(kv: np.ndarray, rope_interleaved: bool) -> np.ndarray:
    """Our [num_layers, num_kv_heads, num_tokens, head_dim] as llama.cpp's [num_layers, num_tokens, heads * dim]."""
    num_layers, heads, num_tokens, head_dim = kv.shape
    rows = kv.transpose(0, 2, 1, 3)  # [num_layers, num_tokens, num_kv_heads, head_dim]
    if rope_interleaved:  # rotate-half (x_i, x_{i+d/2}) pairs -> interleaved (x_2i, x_2i+1) pairs
        rows = rows.reshape(num_layers, num_tokens, heads, 2, head_dim // 2).swapaxes(-1, -2)
    return np.ascontiguousarray(rows, dtype=np.float16).reshape(num_layers, num_tokens, heads * head_dim)


def encode_state(state: SequenceState) -> np.ndarray:
    """The bytes llama_state_seq_set_data reads (one stream), as a uint8 array written in place (no copies)."""
    num_layers, num_cells, _ = state.keys.shape
    if state.values.shape[:2] != state.keys.shape[:2] or state.positions.shape != (num_cells,):
        raise KVSnapshotError(f"keys {state.keys.shape}, values {state.values.shape} and {state.positions.shape[0]} "
                              "positions disagree; pass [num_layers, num_cells, row elements] KV and one position "
                              "per cell")
    k_type, v_type = ggml_type_of(state.keys), ggml_type_of(state.values)
    if state.v_trans and v_type != GGML_TYPE_F16:
        raise KVSnapshotError("a transposed V cache holds f16 values only (llama.cpp needs flash attention, hence "
                              "V in rows, for a quantized V cache)")
    k_row_bytes = state.keys.shape[2] * state.keys.itemsize
    v_row_bytes = state.values.shape[2] * state.values.itemsize
    v_head = 4 + 4 + 4 if state.v_trans else 4 + 8
    size = (4 + 4 + 4 + 4 + num_cells * 12 + 8
            + num_layers * (4 + 8 + num_cells * k_row_bytes + v_head + num_cells * v_row_bytes))
    out = np.empty(size, dtype=np.uint8)
    at = 0

    def put(fmt: str, *values: int) -> None:
        nonlocal at
        struct.pack_into("<" + fmt, out, at, *values)
        at += struct.calcsize("<" + fmt)

    def put_array(array: np.ndarray) -> None:
        nonlocal at
        flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        out[at:at + flat.size] = flat
        at += flat.size

    put("Ii", STATE_MAGIC, state.seq_id)
    put("II", 1, num_cells)  # one stream
    meta = np.empty((num_cells, 3), dtype=np.int32)  # pos, n_seq_id = 1, seq_id
    meta[:, 0], meta[:, 1], meta[:, 2] = state.positions, 1, state.seq_id
    put_array(meta)
    put("II", int(state.v_trans), num_layers)
    for layer in range(num_layers):
        put("iQ", k_type, k_row_bytes)
        put_array(state.keys[layer])
    for layer in range(num_layers):
        if state.v_trans:
            put("iII", GGML_TYPE_F16, 2, state.values.shape[2])
            put_array(state.values[layer].T)  # [width, num_cells]
        else:
            put("iQ", v_type, v_row_bytes)
            put_array(state.values[layer])
    assert at == size, "the state's size was computed from the same fields it writes"
    return out


def decode_state(data: bytes | np.ndarray) -> SequenceState:
    """A one-stream f16 or q8_0 sequence state as llama_state_seq_get_data writes it (the inverse of
    encode_state); the rows are views of `data`, not copies."""
    buf = np.frombuffer(data, dtype=np.uint8)
    magic, seq_id, num_streams, num_cells = struct.unpack_from("<IiII", buf, 0)
    if magic != STATE_MAGIC or num_streams != 1:
        raise KVSnapshotError(f"not a one-stream llama.cpp sequence state (magic {magic:#x}, {num_streams} "
                              "streams); this reader follows llama-cpp-python 0.3.36's llama.cpp")
    at = 16
    meta = buf[at:at + num_cells * 12].view(np.int32).reshape(num_cells, 3)
    if num_cells and not (meta[:, 1] == 1).all():
        raise KVSnapshotError("cells shared by several sequences, or a per-cell extension (M-RoPE): not supported")
    at += num_cells * 12
    v_trans, num_layers = struct.unpack_from("<II", buf, at)
    at += 8

    def rows(which: str) -> np.ndarray:  # [num_cells, row elements] after a type and a row size
        nonlocal at
        ggml_type, row_bytes = struct.unpack_from("<iQ", buf, at)
        dtype = row_dtype(ggml_type, which)
        at += 12 + num_cells * row_bytes
        return buf[at - num_cells * row_bytes:at].view(dtype).reshape(num_cells, row_bytes // dtype.itemsize)

    keys = [rows("K") for _ in range(num_layers)]
    values = []
    for _ in range(num_layers):
        if v_trans:
            v_type, _, width = struct.unpack_from("<iII", buf, at)
            if v_type != GGML_TYPE_F16:
                raise KVSnapshotError(f"a transposed V cache of ggml type {v_type}: only f16 is read transposed")
            at += 12
            values.append(buf[at:at + num_cells * width * 2].view(np.float16).reshape(width, num_cells).T)
            at += num_cells * width * 2
        else:
            values.append(rows("V"))
    return SequenceState(meta[:, 0].copy(), np.stack(keys), np.stack(values), bool(v_trans), seq_id)


def read_snapshot_kv(path: Path, num_tokens: int,
                     expected_ids: list[int] | None = None) -> tuple[list[int], np.ndarray, np.ndarray]:
    """Token ids and keys, values [num_layers, num_kv_heads, num_tokens, head_dim] (float16) of a snapshot's first
    num_tokens, without torch. The caller has checked the file whole (kvcache/snapshot.py SnapshotReader); with
    expected_ids, a snapshot of other tokens is refused (a benchmark restoring it for its own text)."""
    header = read_header(path)
    if header["dtype"] != "float16":
        raise KVSnapshotError(f"{path} holds {header['dtype']} KV; llama.cpp restores an f16 cache from an "
                              "FP16 snapshot only (written by the exact FP16 cache)")
    num_layers, heads, total, head_dim = header["shape"]
    if not 0 < num_tokens <= total:
        raise KVSnapshotError(f"{path} holds {total} tokens, {num_tokens} were asked for; ask for at most {total}")
    with open(path, "rb") as f:
        f.seek(header["_offset"])
        ids = np.frombuffer(f.read(total * 8), dtype=np.int64)[:num_tokens].tolist()
        payload = np.fromfile(f, dtype=np.float16, count=2 * num_layers * heads * total * head_dim)
    if expected_ids is not None and ids != expected_ids:
        raise KVSnapshotError(f"{path} holds the KV of other tokens than the benchmark's; pass the --text the "
                              "snapshot was made from")
    kv = payload.reshape(2, num_layers, heads, total, head_dim)[:, :, :, :num_tokens]
    return ids, kv[0], kv[1]


def probe_layout(llm: Any, token_id: int) -> tuple[bool, int, int]:
    """(v_trans, K type, V type) of this context's cache, read from llama.cpp's own state of one evaluated token
    (then dropped): V's layout follows its flash-attention setting, which an 'auto' setting decides at run time."""
    llm.reset()
    llm.eval([token_id])
    own = decode_state(sequence_bytes(llm))
    llm.reset()
    return own.v_trans, ggml_type_of(own.keys), ggml_type_of(own.values)


def hadamard(n: int) -> np.ndarray:
    """ggml_gen_hadamard's [n, n] orthonormal Walsh-Hadamard matrix (n a power of two; symmetric, its own inverse)."""
    h = np.full((1, 1), 1 / np.sqrt(np.float32(n)), dtype=np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def rotation_sizes(head_dim: int, ggml_type: int) -> tuple[int, int]:
    """(K chunk, V chunk) of the Hadamard rotation llama.cpp applies to a cache of this type; 0 = not rotated."""
    disabled = os.environ.get("LLAMA_ATTN_ROT_DISABLE", "0").strip()
    if ggml_type == GGML_TYPE_F16 or head_dim % 64 or (disabled.lstrip("-").isdigit() and int(disabled)):
        return 0, 0
    nrot_k = 64
    while head_dim % (nrot_k * 2) == 0:
        nrot_k *= 2
    return nrot_k, 64


def as_cache_rows(kv: np.ndarray, ggml_type: int, rope_interleaved: bool, rotation: int = 0) -> np.ndarray:
    """Our [num_layers, num_kv_heads, num_tokens, head_dim] FP16 KV as llama.cpp's rows of `ggml_type`, each
    `rotation` values multiplied by hadamard(rotation) first when it is not 0."""
    rows = to_llama_rows(kv, rope_interleaved)  # [num_layers, num_tokens, width] float16
    if ggml_type == GGML_TYPE_F16:
        return rows
    assert ggml_type == GGML_TYPE_Q8_0, "probe_layout reads only the types ggml_rows knows"
    h = hadamard(rotation) if rotation else None
    out = np.empty((*rows.shape[:2], rows.shape[2] // QK8_0), dtype=Q8_0_BLOCK)
    for layer in range(rows.shape[0]):  # a layer at a time: the float32 temporaries stay one layer's size
        values = rows[layer].astype(np.float32)
        if h is not None:
            chunks = values.reshape(values.shape[0], -1, rotation)  # [num_tokens, width / rotation, rotation]
            values = (chunks @ h.T).reshape(values.shape)  # each chunk x -> H x, as ggml_mul_mat(rot, x)
        out[layer] = quantize_q8_0(values)
    return out


def sequence_bytes(llm: Any, seq_id: int = 0) -> bytes:
    """llama.cpp's own state of one sequence (llama_state_seq_get_data)."""
    import llama_cpp

    size = llama_cpp.llama_state_seq_get_size(llm.ctx, seq_id)
    buf = (ctypes.c_uint8 * size)()
    written = llama_cpp.llama_state_seq_get_data(llm.ctx, buf, size, seq_id)
    if written != size:
        raise KVSnapshotError(f"llama.cpp wrote {written} of {size} state bytes; see its log (verbose=True)")
    return bytes(buf)


def restore_into(llm: Any, token_ids: list[int], keys: np.ndarray, values: np.ndarray) -> None:
    """Put our KV ([num_layers, num_kv_heads, num_tokens, head_dim], post-RoPE) of token_ids into llama.cpp's
    sequence 0 at positions 0..n-1 (as f16 or q8_0 rows, whichever its cache holds), and tell llama-cpp-python
    those tokens are evaluated: the next llm.eval() decodes at position n. Raises KVSnapshotError when the model
    or the cache does not fit the snapshot."""
    arch = llm.metadata.get("general.architecture", "")
    if arch not in ROPE_INTERLEAVED:
        raise KVSnapshotError(f"restoring KV into llama.cpp is written for {sorted(ROPE_INTERLEAVED)}, not {arch!r}; "
                              "decode from a real prefill instead (no --kv-snapshot)")
    num_tokens = keys.shape[2]
    if num_tokens != len(token_ids) or num_tokens >= llm.n_ctx():
        raise KVSnapshotError(f"{num_tokens} cells of KV for {len(token_ids)} tokens in a context of {llm.n_ctx()}; "
                              "open llama.cpp with n_ctx above the restored tokens plus the decode steps")
    v_trans, k_type, v_type = probe_layout(llm, token_ids[0])
    head_dim = keys.shape[3]
    state = SequenceState(np.arange(num_tokens, dtype=np.int32),
                          as_cache_rows(keys, k_type, ROPE_INTERLEAVED[arch], rotation_sizes(head_dim, k_type)[0]),
                          as_cache_rows(values, v_type, False, rotation_sizes(head_dim, v_type)[1]), v_trans)
    write_state(llm, state, token_ids)


def write_state(llm: Any, state: SequenceState, token_ids: list[int]) -> None:
    """llama_state_seq_set_data of `state` into sequence 0, then llama-cpp-python told its cells hold token_ids."""
    import llama_cpp  # here, after restore_into's checks: they need no llama.cpp

    data = encode_state(state)
    read = llama_cpp.llama_state_seq_set_data(llm.ctx, data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)),
                                              data.size, 0)
    if read != data.size:
        raise KVSnapshotError(f"llama.cpp read {read} of {data.size} state bytes (a layer count, row size or cache "
                              "size it refused; see its log with verbose=True): the snapshot's model differs")
    num_tokens = len(token_ids)
    llm.input_ids[:num_tokens] = token_ids
    llm.n_tokens = num_tokens
