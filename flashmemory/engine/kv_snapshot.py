"""A prefilled sequence from a KV snapshot: save the exact cache's KV of a prompt once, restore it into any cache.

What a restore puts in the cache is the prompt's KV as an exact (FP16 contiguous) prefill computed it, written
through the cache's own write path (the tiered cache: the same commit and placement a prefill chunk goes through,
so each level holds its own INT4 / FP16 / INT2 copy and each block its digest). What the configuration's own
prefill would have approximated in those tokens (a tiered prefill's later chunks reading INT2 blocks) is not in
the cache; the prompt's last chunk is always computed afresh by the caller (engine/scoring.py), so prompt hints
and that chunk's KV come from the configuration itself.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from flashmemory.errors import KVSnapshotError
from flashmemory.kvcache.interface import KVCache
from flashmemory.kvcache.snapshot import KVSnapshot, SnapshotReader, save_snapshot

FINGERPRINT_READ_BYTES = 1 << 20  # bytes hashed at each end of every model file (the header, the last tensors)
# The fingerprint's keys that name the model and the KV geometry (not the dtype that computed the KV): a speed
# benchmark restores one snapshot into engines of any dtype (tools/bench/decode_compare.py).
MODEL_IDENTITY_KEYS = ("model", "model_bytes", "model_ends_sha256", "num_layers", "num_kv_heads", "head_dim",
                       "rope_theta")


def model_fingerprint(model_path: Path, model_config: Any, dtype: torch.dtype, weights_dtype: str) -> dict[str, Any]:
    """What the KV of a prompt depends on: the model files (names, sizes, the SHA-256 of both ends of each),
    the compute dtype, how the weights are stored, and the KV geometry."""
    path = Path(model_path)
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.suffix in (".gguf", ".safetensors", ".json") and p.is_file())
    digest = hashlib.sha256()
    total = 0
    for f in files:
        size = f.stat().st_size
        total += size
        digest.update(f"{f.name}:{size}:".encode())
        with open(f, "rb") as fh:
            digest.update(fh.read(FINGERPRINT_READ_BYTES))
            fh.seek(max(0, size - FINGERPRINT_READ_BYTES))
            digest.update(fh.read(FINGERPRINT_READ_BYTES))
    return {
        "model": path.name,
        "model_bytes": total,
        "model_ends_sha256": digest.hexdigest(),
        "dtype": str(dtype).removeprefix("torch."),
        "weights_dtype": weights_dtype,
        "num_layers": model_config.num_layers,
        "num_kv_heads": model_config.num_kv_heads,
        "head_dim": model_config.head_dim,
        "rope_theta": model_config.rope_theta,
    }


def model_identity(fingerprint: dict[str, Any]) -> dict[str, Any]:
    """The part of a fingerprint that names the model and its KV geometry (MODEL_IDENTITY_KEYS)."""
    return {k: fingerprint[k] for k in MODEL_IDENTITY_KEYS}


def engine_fingerprint(engine: Any) -> dict[str, Any]:
    """model_fingerprint of a loaded FlashMemoryEngine."""
    return model_fingerprint(engine.model_path, engine.model_config, engine.dtype,
                             engine.weights_label)


def save_prefill(cache: KVCache, seq_id: int, token_ids: list[int], path: Path, fingerprint: dict[str, Any],
                 notes: dict[str, Any] | None = None) -> None:
    """Snapshot the KV the cache holds for the sequence's first len(token_ids) tokens (the exact cache only)."""
    keys, values = cache.export_kv(seq_id, len(token_ids))
    save_snapshot(path, KVSnapshot(list(token_ids), keys, values, fingerprint, notes or {}))


def restore_prefill(cache: KVCache, seq_id: int, token_ids: list[int], path: Path, fingerprint: dict[str, Any],
                    chunk_tokens: int) -> tuple[int, dict[str, Any]]:
    """Restore the snapshot's KV of token_ids' first tokens into the (empty) sequence, in chunks of chunk_tokens as
    a prefill writes them, stopping at a chunk boundary short of the last token so the caller computes the
    prompt's last chunk itself. Returns the tokens restored and the snapshot's notes."""
    if cache.num_tokens(seq_id):
        raise KVSnapshotError(f"sequence {seq_id} is not empty: a snapshot restores a prompt from its start")
    with SnapshotReader(path, fingerprint, token_ids) as snap:
        geometry = (fingerprint["num_layers"], fingerprint["num_kv_heads"], fingerprint["head_dim"])
        shape = snap.shape
        if (shape[0], shape[1], shape[3]) != geometry:
            raise KVSnapshotError(f"{path} holds KV of shape {shape}, this model's is [{geometry[0]}, "
                                  f"{geometry[1]}, tokens, {geometry[2]}]; delete it and rerun to make a new one")
        last_chunk_start = (len(token_ids) - 1) // chunk_tokens * chunk_tokens
        num_restored = min(last_chunk_start, snap.num_tokens // chunk_tokens * chunk_tokens)
        for start in range(0, num_restored, chunk_tokens):
            end = start + chunk_tokens
            keys, values = snap.read(start, end)
            cache.append_kv(seq_id, keys, values, token_ids[start:end])
        return num_restored, snap.notes
