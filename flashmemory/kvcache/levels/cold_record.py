"""The cold-zone record header: what a block on disk says about itself, so a reader can tell a block of this model,
shape and name from anything else (a torn write, another model's file, a slot rewritten since an index was saved).

Layout (little-endian): magic "FMKV", format version, codec bits, num_layers, num_kv_heads, block_size, head_dim,
16-byte model fingerprint, 16-byte block name (the prefix cache's chain hash; 0 for an unnamed block), the payload's
crc32 per layer, and the crc32 of all of that.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

MAGIC = b"FMKV"
FORMAT_VERSION = 3  # 2: keys and values share one "codes" part; 3: the block's name in the header
_FIXED = struct.Struct("<4sHBxIIII16s16s")  # magic, version, bits, layers, heads, block, dim, fingerprint, name


@dataclass(frozen=True)
class RecordShape:
    """What every record of one cold-zone file must say it is."""

    bits: int
    num_layers: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    fingerprint: bytes  # 16 bytes

    @property
    def header_bytes(self) -> int:
        return _FIXED.size + 4 * self.num_layers + 4

    def pack(self, name: int, crcs: list[int]) -> bytes:
        """The header of a record holding a block called `name` whose layers have these payload crcs."""
        fixed = _FIXED.pack(MAGIC, FORMAT_VERSION, self.bits, self.num_layers, self.num_kv_heads, self.block_size,
                            self.head_dim, self.fingerprint, name.to_bytes(16, "little"))
        head = fixed + struct.pack(f"<{self.num_layers}I", *crcs)
        return head + struct.pack("<I", zlib.crc32(head))

    def parse(self, raw: bytes) -> tuple[int, list[int]] | None:
        """(name, per-layer crcs) of a header this shape wrote; None for anything else (torn, foreign, stale)."""
        if len(raw) < self.header_bytes:
            return None
        head, (crc,) = raw[: self.header_bytes - 4], struct.unpack("<I", raw[self.header_bytes - 4 : self.header_bytes])
        if zlib.crc32(head) != crc:
            return None
        magic, version, bits, layers, heads, block, dim, fp, name = _FIXED.unpack(head[: _FIXED.size])
        expected = (MAGIC, FORMAT_VERSION, self.bits, self.num_layers, self.num_kv_heads, self.block_size,
                    self.head_dim, self.fingerprint)
        if (magic, version, bits, layers, heads, block, dim, fp) != expected:
            return None
        crcs = list(struct.unpack(f"<{self.num_layers}I", head[_FIXED.size :]))
        return int.from_bytes(name, "little"), crcs
