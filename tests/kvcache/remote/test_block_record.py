"""BlockRecord: a block's KV goes out and comes back bit for bit; any value that is not this
block's KV (cut, flipped, another format, model, precision, shape or tokens) is refused by
reason, never decoded."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from flashmemory.kvcache.remote.block_record import (CHECKSUM_BYTES, BlockGeometry,
                                                     RemoteRecordError, decode_record,
                                                     encode_record)

GEOMETRY = BlockGeometry(b"n" * 32, num_layers=2, num_kv_heads=3, block_size=4, head_dim=8)
TOKENS = (5, 6, 7, 8)


def _kv(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(GEOMETRY.shape, generator=g).half(),
            torch.randn(GEOMETRY.shape, generator=g).half())


def _reason(value: bytes, geometry: BlockGeometry = GEOMETRY, tokens=TOKENS) -> str:
    with pytest.raises(RemoteRecordError) as info:
        decode_record(geometry, tokens, value)
    return info.value.reason


def _rechecked(body: bytes) -> bytes:
    return body + hashlib.blake2b(body, digest_size=CHECKSUM_BYTES).digest()


def test_a_record_decodes_to_the_same_bits():
    k, v = _kv()
    got_k, got_v = decode_record(GEOMETRY, TOKENS, encode_record(GEOMETRY, TOKENS, k, v))
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    assert got_k.dtype == torch.float16


def test_every_damaged_or_foreign_value_is_refused_by_reason():
    k, v = _kv()
    value = encode_record(GEOMETRY, TOKENS, k, v)
    assert _reason(value[:-1]) == "truncated"
    assert _reason(value[:5]) == "truncated"
    flipped = bytearray(value)
    flipped[len(value) // 2] ^= 0x10
    assert _reason(bytes(flipped)) == "checksum"
    assert _reason(b"XXXX" + value[4:]) == "format"
    assert _reason(value, BlockGeometry(b"m" * 32, 2, 3, 4, 8)) == "namespace"
    assert _reason(value, BlockGeometry(b"n" * 32, 2, 3, 4, 16)) == "shape"
    assert _reason(value, tokens=(5, 6, 7, 9)) == "tokens"
    assert _reason(b"") == "truncated"


def test_a_value_of_another_precision_is_refused_even_with_a_valid_checksum():
    k, v = _kv()
    value = encode_record(GEOMETRY, TOKENS, k, v)
    header = GEOMETRY.header()
    other = json.dumps({**json.loads(header), "precision": "int8"}, sort_keys=True).encode()
    assert len(other) == len(header)  # "int8" and "fp16": the same length, the same layout
    body = value[:-CHECKSUM_BYTES].replace(header, other)
    assert _reason(_rechecked(body)) == "precision"


def test_a_block_of_the_wrong_shape_is_not_encoded():
    k, v = _kv()
    with pytest.raises(ValueError, match="must be"):
        encode_record(GEOMETRY, TOKENS, k[:1], v[:1])
