"""KV snapshots: a prefilled prompt's exact keys and values in a file, so a long prompt is prefilled once and
restored for every configuration and run (tools/eval.py --kv-snapshot).

File layout (little endian; the frame and header reading in flashmemory/snapshot_format.py, torch-free):
    MAGIC (8 bytes) | header length (8 bytes, uint64) | header (UTF-8 JSON) | token ids (int64) | keys | values
keys and values: [num_layers, num_kv_heads, num_tokens, head_dim] in the header's dtype (the exact cache's
post-RoPE KV). The header names the model fingerprint, the geometry, the payload's size and its SHA-256; loading
checks all of them and never hands back a snapshot that does not match what the caller is about to score.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flashmemory.errors import KVSnapshotError
from flashmemory.snapshot_format import FORMAT_VERSION, MAGIC, read_header, read_header_from, rebuild_hint

HASH_PIECE_BYTES = 16 << 20  # the payload is hashed in pieces of this size
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class KVSnapshot:
    """One sequence's prefilled tokens and their exact KV; `fingerprint` names the model and settings that made
    it, `notes` what the run that made it measured (e.g. the exact prefill's perplexity)."""

    token_ids: list[int]
    keys: torch.Tensor  # [num_layers, num_kv_heads, num_tokens, head_dim]
    values: torch.Tensor  # same shape and dtype as keys
    fingerprint: dict[str, Any]
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def save_snapshot(path: Path, snap: KVSnapshot) -> None:
    """Write `snap` atomically (a temporary file in the same folder, then rename): a reader never sees half."""
    if snap.keys.shape != snap.values.shape or snap.keys.dtype != snap.values.dtype or snap.keys.dim() != 4:
        raise KVSnapshotError(f"keys {tuple(snap.keys.shape)} and values {tuple(snap.values.shape)} must both be "
                              "[num_layers, num_kv_heads, num_tokens, head_dim] of one dtype")
    if snap.keys.shape[2] != snap.num_tokens:
        raise KVSnapshotError(f"{snap.num_tokens} token ids but KV of {snap.keys.shape[2]} tokens")
    dtype = str(snap.keys.dtype).removeprefix("torch.")
    parts = [torch.tensor(snap.token_ids, dtype=torch.int64).numpy().tobytes(),
             snap.keys.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes(),
             snap.values.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()]
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    header = json.dumps({
        "version": FORMAT_VERSION,
        "fingerprint": snap.fingerprint,
        "dtype": dtype,
        "shape": list(snap.keys.shape),
        "payload_bytes": sum(len(p) for p in parts),
        "payload_sha256": digest.hexdigest(),
        "notes": snap.notes,
    }, sort_keys=True).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<Q", len(header)) + header)
            for part in parts:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class SnapshotReader:
    """An open snapshot file, checked whole when opened (fingerprint, tokens, size, SHA-256); its KV is then read a
    token range at a time, so restoring a long prompt never holds the whole file in memory. The file stays open:
    a snapshot replaced meanwhile (a new file renamed over it) is not mixed in."""

    def __init__(self, path: Path, fingerprint: dict[str, Any], token_ids: list[int]) -> None:
        self.path = path
        self._file = open(path, "rb")
        try:
            self._check(fingerprint, token_ids)
        except BaseException:
            self._file.close()
            raise

    def _check(self, fingerprint: dict[str, Any], token_ids: list[int]) -> None:
        path, f = self.path, self._file
        header = read_header_from(f, path)
        mismatched = {k: (header["fingerprint"].get(k), v) for k, v in fingerprint.items()
                      if header["fingerprint"].get(k) != v}
        if mismatched:
            diff = ", ".join(f"{k}: snapshot {a!r}, now {b!r}" for k, (a, b) in sorted(mismatched.items()))
            raise KVSnapshotError(f"{path} was made by another model or settings ({diff}); {rebuild_hint(path)}")
        self.dtype = _DTYPES.get(header["dtype"])
        if self.dtype is None:
            raise KVSnapshotError(f"{path} holds KV of dtype {header['dtype']!r}, not one of {sorted(_DTYPES)}")
        self.shape = tuple(header["shape"])  # [num_layers, num_kv_heads, num_tokens, head_dim]
        num_layers, heads, num_tokens, head_dim = self.shape
        self.element = torch.empty((), dtype=self.dtype).element_size()
        self.kv_bytes = num_layers * heads * num_tokens * head_dim * self.element
        expected = num_tokens * 8 + 2 * self.kv_bytes
        if header["payload_bytes"] != expected:
            raise KVSnapshotError(f"{path}: header payload_bytes {header['payload_bytes']} does not match its "
                                  f"shape ({expected}); {rebuild_hint(path)}")
        self.offset = header["_offset"]
        size = os.fstat(f.fileno()).st_size - self.offset
        if size != expected:
            raise KVSnapshotError(f"{path} is truncated or overlong: the header says {expected} payload bytes, the "
                                  f"file holds {size}; {rebuild_hint(path)}")
        digest = hashlib.sha256()
        f.seek(self.offset)
        for piece in iter(lambda: f.read(HASH_PIECE_BYTES), b""):
            digest.update(piece)
        if digest.hexdigest() != header["payload_sha256"]:
            raise KVSnapshotError(f"{path}: the payload's SHA-256 does not match its header (corrupt); "
                                  f"{rebuild_hint(path)}")
        f.seek(self.offset)
        ids = torch.frombuffer(bytearray(f.read(num_tokens * 8)), dtype=torch.int64).tolist()
        common = min(num_tokens, len(token_ids))
        if ids[:common] != list(token_ids[:common]):
            first = next(i for i, (a, b) in enumerate(zip(ids, token_ids)) if a != b)
            raise KVSnapshotError(f"{path} holds the KV of other tokens (its {num_tokens} tokens and the "
                                  f"{len(token_ids)} to score differ at position {first}); {rebuild_hint(path)}")
        self.token_ids: list[int] = ids
        self.fingerprint: dict[str, Any] = dict(header["fingerprint"])
        self.notes: dict[str, Any] = dict(header.get("notes", {}))

    @property
    def num_tokens(self) -> int:
        return self.shape[2]

    def read(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [num_layers, num_kv_heads, end - start, head_dim] of tokens [start, end)."""
        num_layers, heads, num_tokens, head_dim = self.shape
        if not 0 <= start <= end <= num_tokens:
            raise ValueError(f"token range [{start}, {end}) is outside the snapshot's {num_tokens} tokens")
        out = torch.empty((2, num_layers, heads, end - start, head_dim), dtype=self.dtype)
        rows = out.view(2 * num_layers * heads, -1).view(torch.uint8).numpy()  # one row per (kv, layer, head)
        row_bytes = num_tokens * head_dim * self.element
        for i in range(rows.shape[0]):  # each (kv, layer, head) row is contiguous over tokens in the file
            self._file.seek(self.offset + num_tokens * 8 + i * row_bytes + start * head_dim * self.element)
            if self._file.readinto(memoryview(rows[i])) != rows.shape[1]:
                raise KVSnapshotError(f"{self.path} was cut short while being read; {rebuild_hint(self.path)}")
        return out[0], out[1]

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "SnapshotReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_snapshot(path: Path, fingerprint: dict[str, Any], token_ids: list[int]) -> KVSnapshot:
    """The whole snapshot at `path`, refused (KVSnapshotError naming the difference and the fix) unless it was made
    by `fingerprint`, its tokens and `token_ids` agree as far as both go (a longer snapshot serves a shorter
    prompt), and its payload is whole (size and SHA-256)."""
    with SnapshotReader(path, fingerprint, token_ids) as reader:
        keys, values = reader.read(0, reader.num_tokens)
        return KVSnapshot(reader.token_ids, keys, values, reader.fingerprint, reader.notes)
