"""RecordSigner: the keyed MAC (HMAC-SHA256) that decides whether a persistent cache's files
are trusted.

The CRC-32s in a record's header catch accidents (a torn write, a flipped bit); anyone can
compute them, so a record rewritten with fresh, matching checksums passes them. A MAC needs the
cache's secret (cache_folder.py): after a restart a record is served only if its tag, kept in
the (itself authenticated) index, matches HMAC(key, what it is bound to + its bytes). A tag binds
the record to its slot and to the cache's namespace (model, precision, block size...), so a
genuine record moved to another slot, or one written under other settings, is refused too.

Cost: one HMAC over each record written while persist_cache is on, and one over each record read
back at start-up; reads within one process use the CRCs only (docs/prefix_cache.md has the
figures, from bench/record_mac_cost.py).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

import numpy as np

TAG_BYTES = 32  # HMAC-SHA256
_RECORD = b"flashmemory-kv-record-v1\0"
_INDEX = b"flashmemory-kv-index-v1\0"


class RecordSigner:
    """Owns a persistent cache's MAC key and the namespace its records are bound to."""

    def __init__(self, key: bytes, namespace: bytes) -> None:
        self._key = key
        self.namespace = namespace

    def record_tag(self, slot: int, record: bytes | memoryview) -> bytes:
        """The tag of `record` (header and payload, as written) stored in `slot`."""
        mac = hmac.new(self._key, _RECORD, hashlib.sha256)
        mac.update(len(self.namespace).to_bytes(2, "little") + self.namespace)
        mac.update(slot.to_bytes(8, "little"))
        mac.update(record)
        return mac.digest()

    def record_ok(self, slot: int, record: bytes | memoryview, tag: bytes) -> bool:
        return hmac.compare_digest(self.record_tag(slot, record), tag)

    def index_tag(self, arrays: Mapping[str, np.ndarray]) -> bytes:
        """The tag of an index: every array's name, dtype, shape and bytes, in name order. The
        namespace is one of the arrays, not mixed into the key: an index written under other
        settings still proves it is ours, so its saved sessions are kept."""
        mac = hmac.new(self._key, _INDEX, hashlib.sha256)
        for name in sorted(arrays):
            array = np.ascontiguousarray(arrays[name])
            meta = f"{name}|{array.dtype.str}|{array.shape}".encode()
            mac.update(len(meta).to_bytes(4, "little") + meta)
            mac.update(array.tobytes())
        return mac.digest()

    def index_ok(self, arrays: Mapping[str, np.ndarray], tag: bytes) -> bool:
        return hmac.compare_digest(self.index_tag(arrays), tag)
