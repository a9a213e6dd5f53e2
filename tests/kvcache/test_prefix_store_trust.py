"""The persistent prefix cache as untrusted input: whatever the index or a record holds, recovery
never stops the start, never serves a block that is not exactly what this cache wrote, and counts
and logs what it discarded.

Built without a model: a persistent DiskPool, a PrefixCache and a PrefixStore, as TieredKVCache
composes them."""

from __future__ import annotations

import io
import logging
import os
import struct
import zipfile
import zlib

import numpy as np
import pytest
import torch

from flashmemory.kvcache.levels.cache_folder import KEY_NAME
from flashmemory.kvcache.levels.disk_pool import DiskPool
from flashmemory.kvcache.levels.record_mac import RecordSigner
from flashmemory.kvcache.manager.blocks import BlockEntry, BlockManager, Level
from flashmemory.kvcache.manager.prefix_cache import PrefixCache, chain_hashes
from flashmemory.kvcache.prefix_index import INDEX_NAME, IndexGeometry, write_index
from flashmemory.kvcache.prefix_store import PrefixStore
from flashmemory.kvcache.quant import Codec

LAYERS, HEADS, BS, DIM, SLOTS, VOCAB = 2, 2, 8, 16, 12, 100
NAMESPACE = bytes(range(32))
GEOMETRY = IndexGeometry(BS, (LAYERS, HEADS, 2 * DIM), SLOTS, VOCAB)
TOKENS = [(7 * i + 3) % VOCAB for i in range(6 * BS)]  # six full blocks
SESSIONS = {"alice": TOKENS[: 2 * BS]}


def _disk(folder, namespace: bytes = NAMESPACE) -> DiskPool:
    return DiskPool(Codec(2, BS, 16), SLOTS, LAYERS, HEADS, BS, DIM, folder, b"model",
                    persistent=True, namespace=namespace)


def _save(folder) -> dict[int, tuple[int, tuple[int, ...], dict]]:
    """Write six named blocks and a session, close; returns name -> (slot, tokens, parts)."""
    disk, cache = _disk(folder), PrefixCache(BS, NAMESPACE)
    blocks = BlockManager({Level.DISK: SLOTS}, cache)
    written, digests = {}, {}
    g = torch.Generator().manual_seed(0)
    for i, name in enumerate(chain_hashes(TOKENS, BS, NAMESPACE)):
        slot = blocks.allocate(Level.DISK)
        parts = disk.codec.encode(torch.randn(LAYERS, HEADS, BS, DIM, generator=g),
                                  torch.randn(LAYERS, HEADS, BS, DIM, generator=g))
        disk.put(slot, parts, name)
        entry = BlockEntry(slots={Level.DISK: slot})
        tokens = tuple(TOKENS[i * BS : (i + 1) * BS])
        cache.register(entry, name, tokens)
        cache.release(entry)
        digests[name] = torch.randn(LAYERS, HEADS, 2 * DIM, generator=g)
        written[name] = (slot, tokens, parts)
    PrefixStore(folder, NAMESPACE, GEOMETRY).save(cache, disk, digests, SESSIONS)
    disk.close()
    return written


def _load(folder):
    disk, cache = _disk(folder), PrefixCache(BS, NAMESPACE)
    store = PrefixStore(folder, NAMESPACE, GEOMETRY)
    found, digests = store.load(cache, BlockManager({Level.DISK: SLOTS}, cache), disk)
    return store, cache, disk, found, digests


def _arrays(folder) -> dict[str, np.ndarray]:
    with np.load(folder / INDEX_NAME) as index:
        out = {key: index[key] for key in index.files}
    out.pop("mac")
    return out


def _signer(folder) -> RecordSigner:
    return RecordSigner((folder / KEY_NAME).read_bytes(), NAMESPACE)


def _write_signed(folder, arrays) -> None:
    """Write `arrays` as the index with a valid MAC (what a forger with the key, or a bug, would
    write)."""
    with open(folder / INDEX_NAME, "wb") as f:
        np.savez(f, **arrays, mac=_mac(folder, arrays))


def _mac(folder, arrays) -> np.ndarray:
    return np.frombuffer(_signer(folder).index_tag(arrays), dtype=np.uint8)


def _resigned(change):
    def variant(folder):
        arrays = _arrays(folder)
        change(arrays)
        _write_signed(folder, arrays)
    return variant


def _raw(change):
    def variant(folder):
        path = folder / INDEX_NAME
        path.write_bytes(change(path.read_bytes()))
    return variant


def _set(key, value):
    return _resigned(lambda a: a.__setitem__(key, value(a) if callable(value) else value))


def _edit(key, fn):
    def change(a):
        a[key] = a[key].copy()
        fn(a[key])
    return _resigned(change)


def _npy_with_header(header: str, payload: bytes) -> bytes:
    h = header.encode("latin1")
    h += b" " * (63 - (10 + len(h)) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(h)) + h + payload


def _replace_member(name: str, raw: bytes):
    def variant(folder):
        path = folder / INDEX_NAME
        with zipfile.ZipFile(path) as z:
            members = {i.filename: z.read(i) for i in z.infolist()}
        members[name + ".npy"] = raw
        with zipfile.ZipFile(path, "w") as z:
            for member, data in members.items():
                z.writestr(member, data)
    return variant


def _compressed(folder):
    arrays = _arrays(folder)
    with open(folder / INDEX_NAME, "wb") as f:
        np.savez_compressed(f, **arrays, mac=_mac(folder, arrays))


def _old_format(folder):
    arrays = _arrays(folder)
    arrays["version"] = np.array([1])
    del arrays["tags"]
    with open(folder / INDEX_NAME, "wb") as f:
        np.savez(f, **arrays)


def _symlink_to_copy(folder):
    elsewhere = folder.parent / f"{folder.name}-elsewhere.npz"
    os.replace(folder / INDEX_NAME, elsewhere)
    os.symlink(elsewhere, folder / INDEX_NAME)


def _directory(folder):
    os.unlink(folder / INDEX_NAME)
    os.mkdir(folder / INDEX_NAME)


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :]


def _sessions(text: bytes):
    return _set("sessions", np.frombuffer(text, dtype=np.uint8))


def _deep(n: int) -> bytes:
    return b'{"a": ' + b"[" * n + b"]" * n + b"}"


VARIANTS = {
    # the file itself
    "empty": _raw(lambda b: b""),
    "truncated-header": _raw(lambda b: b[:30]),
    "truncated-half": _raw(lambda b: b[: len(b) // 2]),
    "truncated-last-byte": _raw(lambda b: b[:-1]),
    "random-bytes": _raw(lambda b: os.urandom(len(b))),
    "json-not-zip": _raw(lambda b: b'{"version": 2}'),
    "flipped-byte-middle": _raw(lambda b: _flip(b, len(b) // 2)),
    "flipped-byte-near-end": _raw(lambda b: _flip(b, len(b) - 200)),
    "a-symlink": _symlink_to_copy,
    "a-directory": _directory,
    "older-format": _old_format,
    "compressed": _compressed,
    "another-key": lambda folder: _write_signed_with(folder, os.urandom(32)),
    # keys
    "missing-slots": _resigned(lambda a: a.pop("slots")),
    "missing-tags": _resigned(lambda a: a.pop("tags")),
    "extra-key": _set("extra", np.zeros(3)),
    # dtypes and shapes
    "slots-float": _set("slots", lambda a: a["slots"].astype(np.float64)),
    "slots-big-endian": _set("slots", lambda a: a["slots"].astype(">i8")),
    "tokens-int64": _set("tokens", lambda a: a["tokens"].astype(np.int64)),
    "digests-float32": _set("digests", lambda a: a["digests"].astype(np.float32)),
    "names-narrow": _set("names", lambda a: a["names"][:, :8].copy()),
    "tokens-wider-block": _set("tokens", lambda a: np.pad(a["tokens"], ((0, 0), (0, 1)))),
    "digests-wrong-shape": _set("digests", lambda a: a["digests"][:, :, :1].copy()),
    "slots-2d": _set("slots", lambda a: a["slots"].reshape(-1, 1)),
    "lengths-disagree": _set("slots", lambda a: a["slots"][:-2].copy()),
    "pickled-object": _set("slots", np.array([{"slot": 1}], dtype=object)),
    "pickled-sessions": _set("sessions", np.array(["alice"], dtype=object)),
    "header-claims-huge-shape": _replace_member("slots", _npy_with_header(
        "{'descr': '<i8', 'fortran_order': False, 'shape': (1000000000000,), }", b"\0" * 8)),
    "header-negative-shape": _replace_member("slots", _npy_with_header(
        "{'descr': '<i8', 'fortran_order': False, 'shape': (-2, -3), }", b"\0" * 48)),
    "version-99": _set("version", np.array([99])),
    "namespace-short": _set("namespace", np.zeros(3, dtype=np.uint8)),
    # values
    "digest-nan": _edit("digests", lambda d: d.__setitem__((1, 0, 0, 0), np.nan)),
    "digest-inf": _edit("digests", lambda d: d.__setitem__((2, 1, 1, 3), np.inf)),
    "slot-negative": _edit("slots", lambda s: s.__setitem__(0, -1)),
    "slot-out-of-range": _edit("slots", lambda s: s.__setitem__(1, SLOTS)),
    "slot-huge": _edit("slots", lambda s: s.__setitem__(2, 2**62)),
    "slots-duplicate": _edit("slots", lambda s: s.__setitem__(3, s[4])),
    "names-duplicate": _edit("names", lambda n: n.__setitem__(3, n[4])),
    "name-zero": _edit("names", lambda n: n.__setitem__(0, 0)),
    "token-out-of-vocab": _edit("tokens", lambda t: t.__setitem__((1, 2), VOCAB)),
    "token-negative": _edit("tokens", lambda t: t.__setitem__((2, 0), -5)),
    "tag-swapped": _edit("tags", lambda t: t.__setitem__(slice(0, 2), t[[1, 0]])),
    "slots-swapped": _edit("slots", lambda s: s.__setitem__(slice(0, 2), s[[1, 0]])),
    "sessions-not-json": _sessions(b"\xff{not json"),
    "sessions-a-list": _sessions(b"[1, 2, 3]"),
    "sessions-token-strings": _sessions(b'{"alice": ["1", "2"]}'),
    "sessions-out-of-vocab": _sessions(b'{"alice": [1, 100000], "bob": [1, 2]}'),
    "sessions-booleans": _sessions(b'{"alice": [true, false]}'),
    "sessions-deeply-nested": _sessions(_deep(100_000)),
    "sessions-huge-int": _sessions(b'{"alice": [' + b"9" * 5000 + b"]}"),
}


def _write_signed_with(folder, key: bytes) -> None:
    arrays = _arrays(folder)
    with open(folder / INDEX_NAME, "wb") as f:
        write_index(f, arrays, RecordSigner(key, NAMESPACE))


def test_a_saved_index_is_recovered_whole(tmp_path):
    written = _save(tmp_path)
    store, cache, disk, found, digests = _load(tmp_path)
    assert found.num_blocks == len(written) == len(cache.index) and found.sessions == SESSIONS
    assert store.stats()["persist_records_recovered"] == len(written)
    assert not any(n for key, n in store.stats().items() if "discarded" in key)
    disk.close()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_malformed_index_variants_are_discarded_not_fatal(tmp_path, caplog, variant):
    written = _save(tmp_path)
    VARIANTS[variant](tmp_path)
    with caplog.at_level(logging.INFO, logger="flashmemory.kvcache.prefix_store"):
        store, cache, disk, found, digests = _load(tmp_path)  # never raises
    try:
        stats = store.stats()
        assert sum(n for key, n in stats.items() if "discarded" in key) >= 1, stats  # counted
        lines = [r.getMessage() for r in caplog.records if "discard" in r.getMessage()]
        assert 1 <= len(lines) <= 2, lines  # a line for the index or its entries, one for sessions
        for name, entry in cache.index.items():  # whatever came back is exactly what was written
            slot, tokens, parts = written[name]
            assert entry.slots == {Level.DISK: slot} and entry.token_ids == tokens
            digest = digests[name]
            assert torch.isfinite(digest).all() and digest.shape == (LAYERS, HEADS, 2 * DIM)
            block = disk.read_block(slot)
            assert all(torch.equal(block[p], parts[p]) for p in parts)
        for tokens in found.sessions.values():
            assert all(type(t) is int and 0 <= t < VOCAB for t in tokens)
    finally:
        disk.close()


def test_an_index_of_another_namespace_keeps_its_sessions_not_its_blocks(tmp_path):
    _save(tmp_path)
    disk, cache = _disk(tmp_path, namespace=b"other" * 4), PrefixCache(BS, b"other" * 4)
    store = PrefixStore(tmp_path, b"other" * 4, GEOMETRY)
    found, _ = store.load(cache, BlockManager({Level.DISK: SLOTS}, cache), disk)
    assert found.discarded_namespace and not cache.index and found.sessions == SESSIONS
    disk.close()


def _rewrite_record(folder, slot: int, record: bytes, record_bytes: int) -> None:
    with open(folder / "kv-cache.cold", "r+b") as f:
        f.seek(slot * record_bytes)
        f.write(record)


def test_forged_record_with_valid_crc_is_a_miss(tmp_path):
    written = _save(tmp_path)
    name, (slot, _, _) = next(iter(written.items()))
    disk = _disk(tmp_path)
    header, _ = disk.shape.parse(disk.read_record(slot))
    forged = [os.urandom(disk.segment_bytes) for _ in range(LAYERS)]  # other KV, matching CRCs
    record = disk.shape.pack(name, [zlib.crc32(s) for s in forged]) + b"".join(forged)
    record_bytes = disk.record_bytes
    disk.close()
    _rewrite_record(tmp_path, slot, record, record_bytes)
    store, cache, disk, found, _ = _load(tmp_path)
    assert name not in cache.index and found.num_blocks == len(written) - 1  # a miss
    assert store.stats()["persist_records_discarded_unauthenticated"] == 1
    disk.close()


def test_a_genuine_record_copied_to_another_slot_is_a_miss(tmp_path):
    written = _save(tmp_path)
    (name_a, (slot_a, _, _)), (name_b, (slot_b, _, _)) = list(written.items())[:2]
    disk = _disk(tmp_path)
    record_a, record_bytes = disk.read_record(slot_a), disk.record_bytes
    disk.close()
    _rewrite_record(tmp_path, slot_b, record_a, record_bytes)  # A's bytes and header, in B's slot
    arrays = _arrays(tmp_path)
    slots = arrays["slots"] = arrays["slots"].copy()
    i_a, i_b = int(np.flatnonzero(slots == slot_a)[0]), int(np.flatnonzero(slots == slot_b)[0])
    slots[i_a], slots[i_b] = slot_b, slot_a  # an index, signed with the key: A is in B's slot
    _write_signed(tmp_path, arrays)
    store, cache, disk, _, _ = _load(tmp_path)
    assert name_a not in cache.index and name_b not in cache.index
    assert store.stats()["persist_records_discarded_unauthenticated"] >= 1
    disk.close()


def test_a_cache_copied_without_its_key_is_a_miss(tmp_path):
    _save(tmp_path)
    os.unlink(tmp_path / KEY_NAME)  # e.g. the folder copied to another machine without its secret
    store, cache, disk, found, _ = _load(tmp_path)
    assert not cache.index and store.stats()["persist_index_discarded"] == 1
    assert (tmp_path / KEY_NAME).stat().st_mode & 0o777 == 0o600  # a new one
    disk.close()


def test_a_key_readable_by_others_is_replaced_and_its_cache_discarded(tmp_path, caplog):
    _save(tmp_path)
    os.chmod(tmp_path / KEY_NAME, 0o644)
    with caplog.at_level(logging.WARNING):
        store, cache, disk, _, _ = _load(tmp_path)
    assert not cache.index and "readable by other users" in caplog.text
    assert (tmp_path / KEY_NAME).stat().st_mode & 0o777 == 0o600
    disk.close()


def test_index_created_owner_only(tmp_path):
    os.umask(old := os.umask(0))  # the most permissive umask: the modes are ours, not the umask's
    try:
        _save(tmp_path)
    finally:
        os.umask(old)
    for name in (INDEX_NAME, "kv-cache.cold", KEY_NAME):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o600, name


def test_an_index_left_world_readable_by_an_older_version_is_rewritten_owner_only(tmp_path):
    _save(tmp_path)
    os.chmod(tmp_path / INDEX_NAME, 0o644)
    store, cache, disk, _, digests = _load(tmp_path)
    store.save(cache, disk, digests, {})
    disk.close()
    assert (tmp_path / INDEX_NAME).stat().st_mode & 0o777 == 0o600


def test_symlinked_index_temp_file_is_replaced_not_followed(tmp_path):
    folder, victim = tmp_path / "kv", tmp_path / "victim.txt"
    folder.mkdir(mode=0o700)
    victim.write_bytes(b"x" * 14)
    os.symlink(victim, folder / "kv-cache.index.tmp.npz")
    _save(folder)
    assert victim.read_bytes() == b"x" * 14  # untouched
    assert not (folder / INDEX_NAME).is_symlink()
    assert not (folder / "kv-cache.index.tmp.npz").exists()


def test_an_index_member_is_never_unpickled(tmp_path, monkeypatch):
    _save(tmp_path)
    arrays = _arrays(tmp_path)
    arrays["sessions"] = np.array([object()], dtype=object)
    buf = io.BytesIO()
    np.savez(buf, **arrays, mac=np.zeros(32, dtype=np.uint8))
    (tmp_path / INDEX_NAME).write_bytes(buf.getvalue())
    import pickle

    monkeypatch.setattr(pickle, "load", lambda *a, **k: pytest.fail("a member was unpickled"))
    store, cache, disk, _, _ = _load(tmp_path)
    assert store.stats()["persist_index_discarded"] == 1
    disk.close()
