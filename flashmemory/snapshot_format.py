"""The KV snapshot file's frame, readable without torch: the magic, the format version and the JSON header
(kvcache/snapshot.py writes and checks the whole file; the llama.cpp bench worker, which must not load torch,
reads the payload after this header: tools/bench/llamacpp_state.py).

File layout (little endian):
    MAGIC (8 bytes) | header length (8 bytes, uint64) | header (UTF-8 JSON) | token ids (int64) | keys | values
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, BinaryIO

from flashmemory.errors import KVSnapshotError

MAGIC = b"FMKVSNP1"
FORMAT_VERSION = 1


def rebuild_hint(path: Path) -> str:
    """The fix named by every error about a snapshot file."""
    return f"delete {path} (or pass another --kv-snapshot path) and rerun: the next run prefills and writes it anew"


def read_header(path: Path) -> dict[str, Any]:
    """The snapshot's JSON header (checked for the magic, a readable length and the format version), without the
    payload; header["_offset"] is where the payload starts."""
    with open(path, "rb") as f:
        return read_header_from(f, path)


def read_header_from(f: BinaryIO, path: Path) -> dict[str, Any]:
    """read_header on an open file positioned at its start (left just after the header)."""
    head = f.read(16)
    if len(head) < 16 or head[:8] != MAGIC:
        raise KVSnapshotError(f"{path} is not a FlashMemory KV snapshot (bad magic or truncated); "
                              f"{rebuild_hint(path)}")
    (length,) = struct.unpack("<Q", head[8:])
    raw = f.read(length)
    if len(raw) != length:
        raise KVSnapshotError(f"{path} is truncated inside its header; {rebuild_hint(path)}")
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise KVSnapshotError(f"{path} has a corrupt header ({e}); {rebuild_hint(path)}") from e
    if header.get("version") != FORMAT_VERSION:
        raise KVSnapshotError(f"{path} is format version {header.get('version')}, this build reads "
                              f"{FORMAT_VERSION}; {rebuild_hint(path)}")
    header["_offset"] = 16 + length
    return header
