"""model_content_digest: the SHA-256 of a model's bytes, the identity its KV is named by.

A prompt's KV depends on the model's weights, not on where the file lies: two replicas that load
the same GGUF from different paths must name its blocks alike (the shared level), and a model
moved or copied keeps its persisted prefix cache. Every file of the model is hashed whole (a GGUF;
in a folder its weights, config and tokenizer files, by name), so two fine-tunes of one size that
differ only in the middle of the file are never taken for one. Hashing reads the files once
(about 1.5 GB/s here); the result is cached under the cache root by each file's absolute path,
size and modification time, so a restart does not read them again."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path

from flashmemory.model.tokenizer import cache_root

logger = logging.getLogger(__name__)

DIGEST_SUFFIXES = (".gguf", ".safetensors", ".json", ".model", ".txt", ".bin")
CACHE_NAME = "model-digests.json"
CHUNK_BYTES = 8 << 20
_lock = threading.Lock()


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(p for p in path.iterdir() if p.is_file() and p.suffix in DIGEST_SUFFIXES)


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def _cache_path() -> Path:
    return cache_root() / CACHE_NAME


def _read_cache() -> dict[str, str]:
    try:
        data = json.loads(_cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)} \
        if isinstance(data, dict) else {}


def _write_cache(entries: dict[str, str]) -> None:
    path = _cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(entries, sort_keys=True))
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache root: the digests are computed again next time
        logger.debug("could not keep model digests in %s: %s", path, e)


def model_content_digest(model_path: str | os.PathLike) -> str:
    """SHA-256 (hex) over the model's files: each file's name, size and bytes, in name order."""
    files = _files(Path(model_path))
    with _lock:
        cache = _read_cache()
        changed = False
        total = hashlib.sha256()
        for f in files:
            st = f.stat()
            key = f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}"
            digest = cache.get(key)
            if digest is None:
                digest = cache[key] = _file_digest(f)
                changed = True
            total.update(f"{f.name}:{st.st_size}:{digest}\n".encode())
        if changed:
            _write_cache(cache)
    return total.hexdigest()
