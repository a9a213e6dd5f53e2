"""The persistent prefix index's file format (kv-cache.index.npz), read as untrusted input.

An uncompressed numpy archive (np.savez) of exactly these arrays, little endian:
  version   int64 [1]                 INDEX_VERSION
  namespace uint8 [k]                 the cache's namespace (TieredCacheConfig.prefix_namespace)
  names     uint8 [n, 16]             each block's name (its chain hash, little endian)
  slots     int64 [n]                 its slot in kv-cache.cold
  tokens    int32 [n, block_size]     its token ids
  digests   float16 [n, layers, kv_heads, width]   its selection digest
  tags      uint8 [n, 32]             its record's MAC (levels/record_mac.py)
  sessions  uint8 [m]                 the saved sessions, JSON {name: [token ids]} in UTF-8
  mac       uint8 [32]                the MAC of every array above (RecordSigner.index_tag)
Version history: 1 had neither tags nor mac (rejected: nothing in it can be trusted); 2 as above.

Reading checks, in order, before anything is believed: the archive's members are exactly these,
stored (not compressed), each a plain .npy of the expected dtype and rank whose header agrees
with its size (nothing is unpickled: allow_pickle is never on); the version; the MAC; the
arrays' lengths. Any failure rejects the whole index (IndexRejected, with the reason). Entries
and sessions are then checked one by one (`valid_entries`, `valid_sessions`): a slot out of range
or repeated, a name repeated or zero, token ids outside the vocabulary, a digest that is not
finite or not of this cache's shape, drop that entry or session only.
"""

from __future__ import annotations

import io
import json
import math
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

from flashmemory.kvcache.levels.record_mac import TAG_BYTES, RecordSigner

INDEX_NAME = "kv-cache.index.npz"
INDEX_VERSION = 2
NAME_BYTES = 16
# member -> (dtype, rank); "<": a byte-swapped array is refused, not silently reinterpreted
SCHEMA: dict[str, tuple[np.dtype, int]] = {
    "version": (np.dtype("<i8"), 1), "namespace": (np.dtype("u1"), 1),
    "names": (np.dtype("u1"), 2), "slots": (np.dtype("<i8"), 1), "tokens": (np.dtype("<i4"), 2),
    "digests": (np.dtype("<f2"), 4), "tags": (np.dtype("u1"), 2),
    "sessions": (np.dtype("u1"), 1), "mac": (np.dtype("u1"), 1),
}
PER_ENTRY = ("names", "slots", "tokens", "digests", "tags")
MAX_SESSION_TOKENS = 1 << 24  # far above any context: a longer list is not one this cache wrote


class IndexRejected(Exception):
    """The index as a whole cannot be believed; `reason` says why (for the one log line). Never
    leaves PrefixStore: a rejected index is a cache that starts empty."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class IndexGeometry:
    """What an index of this cache must hold: its entries' shapes and their values' bounds."""

    block_size: int
    digest_shape: tuple[int, int, int]  # [num_layers, num_kv_heads, boxes * 2 * head_dim]
    num_slots: int  # slots of the L2 file
    vocab_size: int  # token ids must be below it (0: unknown, not checked)

    @property
    def max_bytes(self) -> int:
        """An archive larger than this is not one this cache could have written (with 256 MiB
        for the sessions)."""
        digest = 2 * math.prod(self.digest_shape)
        entry = NAME_BYTES + 8 + 4 * self.block_size + digest + TAG_BYTES
        return 4 * self.num_slots * entry + (256 << 20)


@dataclass
class Entry:
    """One index entry that passed its own checks (its record still has to)."""

    name: int
    slot: int
    tokens: tuple[int, ...]
    digest: np.ndarray  # float16 [num_layers, num_kv_heads, width]
    tag: bytes


def write_index(f: BinaryIO, arrays: Mapping[str, np.ndarray], signer: RecordSigner) -> None:
    """Write the arrays (every SCHEMA member but mac) and their MAC."""
    np.savez(f, **arrays, mac=np.frombuffer(signer.index_tag(arrays), dtype=np.uint8))


def read_index(f: BinaryIO, size_bytes: int, signer: RecordSigner,
               geometry: IndexGeometry) -> dict[str, np.ndarray]:
    """The index's arrays once the archive, its version, its MAC and its lengths check out
    (IndexRejected if not)."""
    if size_bytes > geometry.max_bytes:
        raise IndexRejected(f"it is {size_bytes} bytes, more than this cache could have written")
    try:
        members = _members(f)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError,
            NotImplementedError) as e:
        raise IndexRejected(f"it is not a readable archive ({e})") from None
    if "version" in members:
        version = _decode("version", members["version"])
        if version.shape != (1,) or int(version[0]) != INDEX_VERSION:
            raise IndexRejected(f"it is of format {version.tolist()}, this version reads "
                                f"{INDEX_VERSION} (older ones carry no MAC)")
    missing, extra = sorted(set(SCHEMA) - set(members)), sorted(set(members) - set(SCHEMA))
    if missing or extra:
        raise IndexRejected(f"its arrays are not the expected ones (missing {missing}, "
                            f"unexpected {extra})")
    arrays = {name: _decode(name, raw) for name, raw in members.items()}
    mac = arrays.pop("mac")
    if mac.shape != (TAG_BYTES,) or not signer.index_ok(arrays, mac.tobytes()):
        raise IndexRejected("its MAC does not match this cache's key (damaged, forged, or written "
                            "under another key)")
    lengths = {name: arrays[name].shape[0] for name in PER_ENTRY}
    if len(set(lengths.values())) > 1:
        raise IndexRejected(f"its arrays disagree on the number of entries ({lengths})")
    if arrays["names"].shape[1] != NAME_BYTES or arrays["tags"].shape[1] != TAG_BYTES:
        raise IndexRejected("its names or tags have the wrong width")
    return arrays


def _members(f: BinaryIO) -> dict[str, bytes]:
    """Each member's bytes by array name; repeated, compressed or encrypted members refused."""
    out: dict[str, bytes] = {}
    with zipfile.ZipFile(f) as archive:
        for info in archive.infolist():
            name = info.filename.removesuffix(".npy")
            if name in out or not info.filename.endswith(".npy"):
                raise ValueError(f"unexpected member {info.filename!r}")
            if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 0x1:
                raise ValueError(f"member {info.filename!r} is compressed or encrypted")
            out[name] = archive.read(info)  # checks the member's CRC
    return out


def _decode(name: str, raw: bytes) -> np.ndarray:
    """One .npy member as an array of SCHEMA's dtype and rank, its header agreeing with its size
    (read here, so a header that claims a huge shape allocates nothing)."""
    if name not in SCHEMA:
        raise IndexRejected(f"it holds an unexpected array {name!r}")
    want_dtype, want_rank = SCHEMA[name]
    f = io.BytesIO(raw)
    try:
        version = np.lib.format.read_magic(f)
        read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                       (2, 0): np.lib.format.read_array_header_2_0}.get(version)
        if read_header is None:
            raise ValueError(f"npy format {version}")
        shape, fortran, dtype = read_header(f)
    except (ValueError, EOFError, SyntaxError, TypeError) as e:
        raise IndexRejected(f"its {name} array is malformed ({e})") from None
    if dtype.hasobject:
        raise IndexRejected(f"its {name} array holds Python objects (pickles are never loaded)")
    if dtype != want_dtype or len(shape) != want_rank or fortran or any(d < 0 for d in shape):
        raise IndexRejected(f"its {name} array is {dtype.str}{list(shape)}, not {want_dtype.str} "
                            f"of rank {want_rank}")
    count = math.prod(shape)
    if f.tell() + count * dtype.itemsize != len(raw):
        raise IndexRejected(f"its {name} array's header does not match its size")
    return np.frombuffer(raw, dtype=dtype, count=count, offset=f.tell()).reshape(shape)


def valid_entries(arrays: Mapping[str, np.ndarray],
                  geometry: IndexGeometry) -> tuple[list[Entry], int]:
    """The entries that pass their own checks, and how many did not."""
    n = arrays["slots"].shape[0]
    tokens, digests = arrays["tokens"], arrays["digests"]
    if tokens.shape[1:] != (geometry.block_size,) or digests.shape[1:] != geometry.digest_shape:
        return [], n  # the namespace matched, so this is damage: none can be read right
    vocab = geometry.vocab_size
    in_vocab = (tokens >= 0).all(axis=1) & ((tokens < vocab).all(axis=1) if vocab else True)
    finite = np.isfinite(digests.reshape(n, -1)).all(axis=1)
    entries: list[Entry] = []
    seen_slots: set[int] = set()
    seen_names: set[int] = set()
    for i, slot in enumerate(arrays["slots"].tolist()):
        name = int.from_bytes(arrays["names"][i].tobytes(), "little")
        if (not 0 <= slot < geometry.num_slots or slot in seen_slots or name in seen_names
                or not name or not in_vocab[i] or not finite[i]):
            continue
        seen_slots.add(slot)
        seen_names.add(name)
        entries.append(Entry(name, slot, tuple(tokens[i].tolist()), digests[i],
                             arrays["tags"][i].tobytes()))
    return entries, n - len(entries)


def valid_sessions(raw: np.ndarray, vocab_size: int) -> tuple[dict[str, list[int]], int]:
    """The saved sessions whose name and token ids are well-formed, and how many were not (a list
    that cannot be read counts as one)."""
    try:
        sessions = json.loads(raw.tobytes().decode("utf-8") or "{}")
    except (ValueError, RecursionError):
        return {}, 1
    if not isinstance(sessions, dict):
        return {}, 1
    good = {name: tokens for name, tokens in sessions.items()
            if _valid_session(name, tokens, vocab_size)}
    return good, len(sessions) - len(good)


def _valid_session(name: object, tokens: object, vocab_size: int) -> bool:
    if not isinstance(name, str) or not name or not isinstance(tokens, list):
        return False
    return len(tokens) <= MAX_SESSION_TOKENS and all(
        type(t) is int and 0 <= t and (not vocab_size or t < vocab_size) for t in tokens)
