"""BlockRecord: one full block's KV as the shared level stores it, one value per key.

    MAGIC (4) | format version (u16) | header length (u32) | header (JSON) | token ids (int32,
    block_size) | keys then values (float16, [num_layers, num_kv_heads, block_size, head_dim]
    each) | checksum (BLAKE2b-16 of everything before it)

The header names what the KV depends on: the prefix cache's namespace (model, every level's
precision, block size, geometry: kvcache/config.py prefix_namespace), the payload's precision,
the block size and the shape. A reader believes a value only whole: the right length, the
checksum, then every header field and the token ids against its own; anything else is a miss by
its reason (RemoteRecordError), never KV served. The payload is the block's FP16 master copy,
what a prefill of the same tokens writes to L1, so a block read from the shared level is the
block this replica would have computed."""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass

import numpy as np
import torch

from flashmemory.errors import FlashMemoryError

MAGIC = b"FMKV"
FORMAT_VERSION = 1
PRECISION = "fp16"  # the payload: the block's FP16 master copy
CHECKSUM_BYTES = 16
_PREFIX = struct.Struct("<4sHI")  # magic, format version, header length


class RemoteRecordError(FlashMemoryError, ValueError):
    """A value of the shared level that is not this block's KV: a miss, never served."""

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        # "truncated" | "checksum" | "format" | "namespace" | "precision" | "shape" | "tokens"
        self.reason = reason


@dataclass(frozen=True)
class BlockGeometry:
    """What every record of one cache shares: its namespace and one block's KV shape."""

    namespace: bytes  # the prefix cache's namespace
    num_layers: int
    num_kv_heads: int
    block_size: int
    head_dim: int

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.num_layers, self.num_kv_heads, self.block_size, self.head_dim)

    def header(self) -> bytes:
        return json.dumps({"namespace": self.namespace.hex(), "precision": PRECISION,
                           "block_size": self.block_size, "shape": list(self.shape)},
                          sort_keys=True).encode()

    @property
    def payload_bytes(self) -> int:
        return 2 * int(np.prod(self.shape)) * 2  # keys and values, float16


def encode_record(geometry: BlockGeometry, token_ids: tuple[int, ...], keys: torch.Tensor,
                  values: torch.Tensor) -> bytes:
    """The value for a block: keys, values [num_layers, num_kv_heads, block_size, head_dim]."""
    if tuple(keys.shape) != geometry.shape or tuple(values.shape) != geometry.shape:
        raise ValueError(f"a block's KV must be {geometry.shape}, got {tuple(keys.shape)}")
    header = geometry.header()
    body = b"".join((
        _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header)), header,
        np.asarray(token_ids, dtype="<i4").tobytes(),
        keys.detach().to("cpu", torch.float16).contiguous().numpy().tobytes(),
        values.detach().to("cpu", torch.float16).contiguous().numpy().tobytes()))
    return body + hashlib.blake2b(body, digest_size=CHECKSUM_BYTES).digest()


def decode_record(geometry: BlockGeometry, token_ids: tuple[int, ...],
                  value: bytes) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's keys and values (float16, on the CPU) from a value read for it; raises
    RemoteRecordError naming why the value is not them."""
    if len(value) < _PREFIX.size:
        raise RemoteRecordError(f"{len(value)} bytes, not a record", reason="truncated")
    magic, version, header_len = _PREFIX.unpack_from(value)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise RemoteRecordError(f"format {magic!r} v{version}, this reader's is {MAGIC!r} "
                                f"v{FORMAT_VERSION}", reason="format")
    header = _own_header(value, header_len)
    size = _record_bytes(header_len, header)
    if len(value) != size:  # the length its own header gives it
        reason = "truncated" if len(value) < size else "format"
        raise RemoteRecordError(f"{len(value)} bytes where its header says {size}",
                                reason=reason)
    body, checksum = value[:-CHECKSUM_BYTES], value[-CHECKSUM_BYTES:]
    if hashlib.blake2b(body, digest_size=CHECKSUM_BYTES).digest() != checksum:
        raise RemoteRecordError("the checksum does not match the bytes", reason="checksum")
    _check_header(header, geometry)
    start = _PREFIX.size + header_len
    stored = tuple(np.frombuffer(value, "<i4", geometry.block_size, start).tolist())
    if stored != tuple(token_ids):
        raise RemoteRecordError("the record holds other tokens (a hash collision)",
                                reason="tokens")
    start += geometry.block_size * 4
    count = int(np.prod(geometry.shape))
    kv = np.frombuffer(value, np.float16, 2 * count, start).reshape(2, *geometry.shape)
    kv = torch.from_numpy(kv.copy())
    return kv[0], kv[1]


def _own_header(value: bytes, header_len: int) -> dict:
    raw = value[_PREFIX.size : _PREFIX.size + header_len]
    if len(raw) < header_len:
        raise RemoteRecordError("cut inside its header", reason="truncated")
    try:
        header = json.loads(raw)
        shape = [int(n) for n in header["shape"]]
        int(header["block_size"])
    except (ValueError, KeyError, TypeError) as e:
        raise RemoteRecordError(f"an unreadable header ({e})", reason="format") from e
    if len(shape) != 4 or min(shape) < 1:
        raise RemoteRecordError(f"a header with shape {shape}", reason="format")
    return header


def _record_bytes(header_len: int, header: dict) -> int:
    """A record's length from its header: prefix, header, tokens, payload, checksum."""
    payload = 2 * int(np.prod([int(n) for n in header["shape"]])) * 2
    return _PREFIX.size + header_len + 4 * int(header["block_size"]) + payload + CHECKSUM_BYTES


def _check_header(found: dict, geometry: BlockGeometry) -> None:
    if found.get("namespace") != geometry.namespace.hex():
        raise RemoteRecordError("written under another model, precision or block size",
                                reason="namespace")
    if found.get("precision") != PRECISION:
        raise RemoteRecordError(f"precision {found.get('precision')!r}, this reader's is "
                                f"{PRECISION!r}", reason="precision")
    if found.get("block_size") != geometry.block_size or \
            found.get("shape") != list(geometry.shape):
        raise RemoteRecordError(f"shape {found.get('shape')}, this cache's is "
                                f"{list(geometry.shape)}", reason="shape")
