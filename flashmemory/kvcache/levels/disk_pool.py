"""L2 cold pool: one preallocated file of fixed-size block records, each layer segment checksummed.

Record layout, one per slot at offset slot * record_bytes: the header (cold_record.py: format, shape, model
fingerprint, the block's name, a crc32 per layer segment), then num_layers segments, each the codec's parts of that
layer concatenated in part order. The file is private scratch space (named after its process, removed on close),
or with `persistent=True` the stable kv-cache.cold of its folder (cache_folder.py: a private
folder, no links followed, 0600), kept for the next process (locked while open); there every
record written also gets a keyed MAC (record_mac.py), which the prefix index keeps so the next
process trusts only what this one wrote.

A read verifies the file still exists, is long enough, and that the segment's crc32 matches what was
written; any failure raises ColdBlockError and is counted by reason. A corrupt block is never served.
A file deleted under a running process loses nothing: it is re-created with the live records
carried over (cold_file.py); while it cannot be, `health` says why.
NOTE: error messages name no file (clients may see them); the log does.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from flashmemory.errors import ColdBlockError, ColdZoneFullError, ColdZoneWriteError
from flashmemory.kvcache.levels.cache_folder import CacheFolder
from flashmemory.kvcache.levels.cold_file import ColdFile
from flashmemory.kvcache.levels.cold_record import RecordShape
from flashmemory.kvcache.levels.compaction import CompactResult, punch_freed
from flashmemory.kvcache.levels.file_io import PositionalIO
from flashmemory.kvcache.levels.record_mac import RecordSigner
from flashmemory.kvcache.levels.protocol import LeftRecord, Slots
from flashmemory.kvcache.manager.blocks import Level
from flashmemory.kvcache.quant import Codec, Parts

logger = logging.getLogger(__name__)


class BatchRead(Protocol):
    """Reads segments of `segment_bytes` at `offsets` of `fd` into out [n, segment_bytes] and checks each against
    its CRC-32: None when all are good, anything else when one is not (the per-segment read then says which)."""

    def __call__(self, fd: int, offsets: np.ndarray, segment_bytes: int, expected_crcs: np.ndarray,
                 out: np.ndarray) -> object: ...


class DiskPool:
    """Owns the cold-zone file: put/get of encoded blocks by slot, with integrity checks and failure counters."""

    level: int = Level.DISK  # its position (the registry sets it where the file is another level)

    def __init__(
        self,
        codec: Codec,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        block_size: int,
        head_dim: int,
        directory: str | os.PathLike | None,
        model_fingerprint: bytes,
        io: PositionalIO | None = None,
        persistent: bool = False,
        namespace: bytes = b"",
    ) -> None:
        self.codec = codec
        self.io = io or PositionalIO()  # positional reads/writes (a fault-injecting one in stress tests)
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.lead = (num_kv_heads,)
        self.block_size = block_size
        self.head_dim = head_dim
        self.fingerprint = model_fingerprint[:16].ljust(16, b"\0")
        self.shape = RecordShape(codec.bits, num_layers, num_kv_heads, block_size, head_dim, self.fingerprint)
        self.part_shapes = codec.part_shapes(self.lead, block_size, head_dim)
        self.segment_bytes = codec.nbytes(self.lead, block_size, head_dim)
        self.header_bytes = self.shape.header_bytes
        self.record_bytes = -(-(self.header_bytes + num_layers * self.segment_bytes) // 4096) * 4096
        self.bytes_per_slot = num_layers * self.segment_bytes
        self.load_failures: dict[str, int] = {"missing": 0, "truncated": 0, "checksum": 0, "header": 0}
        self.write_failures: dict[str, int] = {"full": 0, "io": 0}
        self.bytes_written = 0
        self.bytes_read = 0
        self._crcs: dict[int, list[int]] = {}  # slot -> per-layer crc32 of what was written
        self._tags: dict[int, bytes] = {}  # slot -> its record's MAC (persistent only)
        # Bumped when a slot is (re)written or freed, before the bytes change: a copy read ahead of need (prefetch)
        # is served only while its slot's generation is the one it was read under.
        self._generations: dict[int, int] = {}
        # Slots freed since they were last written: their disk blocks are still allocated until a
        # compaction (levels/compaction.py) gives them back.
        self._freed: set[int] = set()
        self.bytes_reclaimed = 0
        self.uncached_reads = False  # drop each read record from the OS page cache (see set_uncached_reads)
        # A batched read of many segments (the native kernel's, plugged in by the cache: use_batch_read).
        self._batch_read: BatchRead | None = None
        self._counter_lock = threading.Lock()  # reads also come from prefetch threads
        self.file = ColdFile(num_slots * self.record_bytes, directory, persistent)
        self.persistent = persistent
        # A persistent file's records get a MAC, kept by the prefix index: the next process
        # trusts only those.
        self.signer = RecordSigner(self.file.secret, namespace) if persistent else None

    @property
    def _fd(self) -> int:
        return self.file.fd

    @property
    def path(self) -> Path:
        return self.file.path

    @property
    def folder(self) -> CacheFolder | None:
        """The checked folder of a persistent file (where its index lives); None for scratch."""
        return self.file.folder

    def persistence(self) -> DiskPool | None:
        """A persistent file is its own PersistentMedium (levels/protocol.py); scratch space is
        none."""
        return self if self.persistent else None

    def read_record(self, slot: int) -> bytes:
        """The slot's whole record as stored (header and every layer), for a MAC check (short at
        the end of a truncated file)."""
        return self.io.pread(self._fd, self.header_bytes + self.num_layers * self.segment_bytes,
                             slot * self.record_bytes)

    def read_left(self, slot: int) -> LeftRecord | None:
        """The block name and checksums the slot's header gives, with the whole record; None
        where the header is not one of ours (format, shape, model)."""
        record = self.read_record(slot)
        header = self.shape.parse(record)
        return None if header is None else LeftRecord(header[0], header[1], record)

    def tag_of(self, slot: int) -> bytes | None:
        """The MAC of the record in `slot` (None: it holds none, or the file is not persistent)."""
        return self._tags.get(slot)

    def adopt(self, slot: int, left: LeftRecord, tag: bytes | None = None) -> None:
        """Serve the block a previous process wrote in `slot` (its checksums read back from its
        header, its MAC checked by the caller)."""
        self._crcs[slot] = left.crcs
        if tag is not None:
            self._tags[slot] = tag

    def sync(self) -> None:
        """Flush the file to the disk (before an index that refers to it is published)."""
        self.file.sync()

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.bytes_per_slot

    def close(self) -> None:
        if hasattr(self, "file"):
            self.file.close()

    def __del__(self) -> None:  # best effort; the engine closes explicitly
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass

    def _segment(self, parts: Parts, layer: int) -> bytes:
        return b"".join(parts[name][layer].contiguous().cpu().numpy().tobytes() for name in self.part_shapes)

    def set_uncached_reads(self, enabled: bool) -> None:
        """Make every read come from the disk, not the OS page cache: random-access advice (no readahead) and,
        after each read, POSIX_FADV_DONTNEED on the record (for honest cold-level measurements)."""
        self.uncached_reads = enabled and hasattr(os, "posix_fadvise")
        if self.uncached_reads:
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)
            self.drop_page_cache()

    def drop_page_cache(self) -> None:
        """Write dirty pages back, then ask the OS to drop the whole file from its page cache."""
        if self._fd >= 0 and hasattr(os, "posix_fadvise"):
            os.fdatasync(self._fd)
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def put(self, slot: int, parts: Parts, name: int = 0) -> None:
        """Write a block (parts shaped [num_layers, num_kv_heads, ...]) into `slot`, completely or not at all as far
        as readers know: a failed write raises ColdZoneFullError (no room) or ColdZoneWriteError, counted, and the
        slot holds no block afterwards (the caller gives it back)."""
        self._generations[slot] = self._generations.get(slot, 0) + 1
        self._crcs.pop(slot, None)  # from here until the write completes, the slot serves nothing
        self._tags.pop(slot, None)
        self._freed.discard(slot)
        segments = [self._segment(parts, layer) for layer in range(self.num_layers)]
        crcs = [zlib.crc32(s) for s in segments]
        record = self.shape.pack(name, crcs) + b"".join(segments)
        try:
            with self.file.lock:  # not into a file a replacement is leaving
                self._ensure_file()
                self.io.pwrite(self._fd, record, slot * self.record_bytes)
        except OSError as e:
            full = e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
            with self._counter_lock:
                self.write_failures["full" if full else "io"] += 1
            logger.warning("writing cold slot %d to %s failed: %s", slot, self.path, e)
            if full:
                raise ColdZoneFullError(f"the cold zone's disk is full ({e.strerror}); free disk "
                                        "space in cold_zone_dir, lower cold_zone_gb, or shorten "
                                        "the context") from e
            raise ColdZoneWriteError(f"writing cold slot {slot} failed: {e.strerror or e}") from e
        self._crcs[slot] = crcs
        if self.signer is not None:
            self._tags[slot] = self.signer.record_tag(slot, record)
        self.bytes_written += len(record)

    def free(self, slot: int) -> None:
        """Forget a slot: its magic is zeroed so stale bytes can never be read back as a block."""
        self._generations[slot] = self._generations.get(slot, 0) + 1
        self._tags.pop(slot, None)
        if self._crcs.pop(slot, None) is not None and self._fd >= 0:
            self._freed.add(slot)
            try:
                self.io.pwrite(self._fd, b"\0\0\0\0", slot * self.record_bytes)
            except OSError:
                pass  # its checksums are gone, so the stale bytes are never served either way

    def generation_of(self, slot: int) -> int:
        return self._generations.get(slot, 0)

    def compact(self, should_stop: Callable[[], bool] = lambda: False) -> CompactResult:
        """Give back the disk blocks of the records freed since they were written (idle time
        only: never call it during a step); live records are not touched."""
        if self._fd < 0 or not self._freed:
            now = self.committed_bytes()
            return CompactResult(bytes_before=now, bytes_after=now)
        with self.file.lock:  # not while a replacement file is being built
            result = punch_freed(self._fd, self._freed, self.record_bytes, self.committed_bytes,
                                 should_stop)
        self.bytes_reclaimed += max(0, result.bytes_before - result.bytes_after)
        return result

    def _fail(self, reason: str, message: str, count: bool = True) -> ColdBlockError:
        if count:
            with self._counter_lock:
                self.load_failures[reason] += 1
        logger.debug("%s (%s)", message, self.path)
        return ColdBlockError(message, reason=reason)

    def read_segment(self, slot: int, layer: int, count_failures: bool = True) -> bytes:
        """One layer of one slot, verified against its crc32 (a torn or stale read raises ColdBlockError).
        Safe from several threads (positional reads). Prefetch reads pass count_failures=False: a slot rewritten
        under them is a race they lose, not a disk fault."""
        expected = self._crcs.get(slot)
        if expected is None:
            raise self._fail("header", f"cold block slot {slot} holds no block", count_failures)
        offset = slot * self.record_bytes + self.header_bytes + layer * self.segment_bytes
        data = self.io.pread(self._fd, self.segment_bytes, offset)
        if self.uncached_reads:
            os.posix_fadvise(self._fd, slot * self.record_bytes, self.record_bytes, os.POSIX_FADV_DONTNEED)
        if len(data) < self.segment_bytes:
            raise self._fail("truncated", f"the cold-zone file is truncated at slot {slot}",
                             count_failures)
        if zlib.crc32(data) != expected[layer]:
            raise self._fail("checksum", f"cold block slot {slot} layer {layer} failed its checksum", count_failures)
        with self._counter_lock:
            self.bytes_read += len(data)
        return data

    def check_file(self) -> None:
        """Move to a new file if the cold-zone file was deleted under us (its blocks carried
        over: cold_file.py); ColdBlockError("missing") once the pool is closed (a read-ahead
        thread outliving it)."""
        if self._fd < 0:
            raise self._fail("missing", "the cold zone is closed")
        self._ensure_file()

    def health(self) -> str | None:
        """Why the level is not as it should be (its file deleted and not replaceable), or None;
        probes the file."""
        self._ensure_file()
        return self.file.failed

    def _ensure_file(self) -> None:
        moved = self.file.ensure(self._live_ranges)
        if moved and self.uncached_reads and self.file.failed is None:
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)

    def _live_ranges(self) -> list[tuple[int, int]]:
        """The byte ranges of the records in use (what a new file must hold), in file order."""
        return [(slot * self.record_bytes, self.record_bytes) for slot in sorted(self._crcs)]

    def counters(self) -> dict[str, int]:
        with self._counter_lock:
            out = {"bytes_read": self.bytes_read}
            out.update({f"load_failures_{reason}": n for reason, n in self.load_failures.items()})
            out.update({f"write_failures_{reason}": n for reason, n in self.write_failures.items()})
        out["bytes_committed"] = self.committed_bytes()
        out["bytes_reclaimable"] = len(self._freed) * self.record_bytes
        out["bytes_reclaimed"] = self.bytes_reclaimed
        out["file_recreated"] = self.file.num_recreated
        out["files_refused"] = self.file.folder.num_refused if self.file.folder is not None else 0
        out["failed"] = int(self.file.failed is not None)
        return out

    def committed_bytes(self) -> int:
        """Disk space the (sparse) file really takes now."""
        try:
            return os.fstat(self._fd).st_blocks * 512 if self._fd >= 0 else 0
        except (OSError, AttributeError):  # st_blocks is POSIX-only
            return 0

    def check_medium(self) -> None:
        self.check_file()

    def use_batch_read(self, read: BatchRead | None) -> None:
        """Read a layer's segments with one call of `read` (None: one Python read per segment). Used only with the
        plain positional I/O (not the portable seek-based one) and cached reads; a substituted io (fault injection)
        keeps the per-segment path."""
        self._batch_read = read

    def get_layer(self, slots: list[int], layer: int) -> Parts:
        """One layer of several slots: parts [len(slots), num_kv_heads, ...], every segment verified."""
        self.check_file()
        data = self._read_batch(slots, layer)
        if data is None:  # no batched read here, or a segment failed it: read one by one (raises and counts)
            data = b"".join(self.read_segment(slot, layer) for slot in slots)
        return self.unflatten(data, len(slots))

    def _read_batch(self, slots: list[int], layer: int) -> np.ndarray | None:
        if (self._batch_read is None or type(self.io) is not PositionalIO or self.io.portable or self.uncached_reads
                or not slots):
            return None
        crcs = np.empty(len(slots), dtype=np.uint32)
        for i, slot in enumerate(slots):
            expected = self._crcs.get(slot)
            if expected is None:
                return None
            crcs[i] = expected[layer]
        offsets = np.asarray(slots, dtype=np.int64) * self.record_bytes + (self.header_bytes
                                                                           + layer * self.segment_bytes)
        out = np.empty((len(slots), self.segment_bytes), dtype=np.uint8)
        if self._batch_read(self._fd, offsets, self.segment_bytes, crcs, out) is not None:
            return None
        with self._counter_lock:
            self.bytes_read += out.size
        return out

    def read_layer(self, slots: Slots, layer: int) -> Parts:
        slots = slots.tolist() if isinstance(slots, torch.Tensor) else list(slots)
        return {name: t.transpose(0, 1) for name, t in self.get_layer(slots, layer).items()}

    def read_block(self, slot: int) -> Parts:
        layers = [self.get_layer([slot], layer) for layer in range(self.num_layers)]  # each [1, heads, ...]
        return {name: torch.cat([p[name] for p in layers]) for name in layers[0]}

    def parts_from_segments(self, data: bytes, n: int) -> Parts:
        return self.unflatten(data, n)

    def verify_header(self, slot: int) -> None:
        """Check a slot's on-disk header (magic, version, shape, fingerprint, header crc)."""
        raw = self.io.pread(self._fd, self.header_bytes, slot * self.record_bytes)
        if len(raw) < self.header_bytes:
            raise self._fail("truncated", f"the cold-zone file is truncated at slot {slot}")
        if self.shape.parse(raw) is None:
            raise self._fail("header", f"cold block slot {slot} has a bad header (format, shape or model mismatch)")

    def unflatten(self, data: bytes | np.ndarray, n: int) -> Parts:
        # data is n segments back to back; each segment is the parts in order, for one slot.
        if isinstance(data, np.ndarray):
            buf = data.reshape(n, self.segment_bytes)
        else:
            buf = np.frombuffer(bytearray(data), dtype=np.uint8).reshape(n, self.segment_bytes)
        parts: Parts = {}
        offset = 0
        for name, (shape, dtype) in self.part_shapes.items():
            numel = int(np.prod(shape))
            size = numel * torch.empty((), dtype=dtype).element_size()
            raw = np.ascontiguousarray(buf[:, offset : offset + size])
            parts[name] = torch.from_numpy(raw).view(dtype).reshape(n, *shape)
            offset += size
        return parts
