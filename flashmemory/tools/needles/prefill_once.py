"""A shared haystack prefilled once: by the exact cache into a KV snapshot, restored into each
configuration.

With a snapshot folder, the exact (FP16 contiguous) cache prefills each haystack once and writes its
KV there
(engine/kv_snapshot.py; a later run with the same model, text and trials finds the file and skips
it). Each
configuration then restores the haystack through its own cache's write path (each level's own copy,
digests,
placement, as a prefill chunk leaves them), computes the haystack's last chunk itself, and frees it
into its
prefix cache: every trial of the haystack reuses it and prefills only its question. Without a folder
each
configuration prefills the haystack itself once (its own approximations included) and the trials
reuse that.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashmemory.engine.kv_snapshot import engine_fingerprint, restore_prefill, save_prefill

EXACT_KNOBS: dict[str, Any] = {"kv_cache": "contiguous", "kv_precision": "fp16"}
MIB = 1 << 20
KEEP_MARGIN = (
    1.25  # the prefix cache keeps this much more than one haystack's FP16 KV (questions, answers)
)


@dataclass
class Warmed:
    """What warming one haystack into a configuration's cache took."""

    tokens: int
    restored_tokens: int
    seconds: float


def fp16_kv_bytes(engine, tokens: int) -> int:
    """Bytes of FP16 keys and values for `tokens` tokens of the engine's model."""
    mc = engine.model_config
    return 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 2 * tokens


def keep_knobs(engine, tokens: int, knobs: dict[str, Any]) -> dict[str, Any]:
    """`knobs` with prefix-cache budgets that keep a `tokens`-token haystack between its trials
    (what a cache
    keeps after a request, not what a request reads; a budget the configuration names stays its
    own)."""
    need_mb = KEEP_MARGIN * fp16_kv_bytes(engine, tokens) / MIB
    out = dict(knobs)
    for name in ("prefix_cache_host_mb", "prefix_cache_disk_mb"):
        out.setdefault(name, max(need_mb, getattr(engine.config, name)))
    return out


class HaystackPrefill:
    """Warms shared haystacks into the engine's current cache; makes their snapshots first when a
    folder is given."""

    def __init__(
        self, snapshot_dir: Path | None = None, log: Callable[[str], None] = lambda _m: None
    ) -> None:
        self.snapshot_dir = snapshot_dir
        self.log = log
        self.snapshot_seconds: dict[
            str, float
        ] = {}  # file name -> the exact prefill that made it, this run

    def snapshot_path(self, engine, ids: list[int]) -> Path:
        assert self.snapshot_dir is not None
        name = hashlib.sha256(repr((engine_fingerprint(engine), ids)).encode()).hexdigest()[:16]
        return self.snapshot_dir / f"haystack-{len(ids)}-{name}.kvsnap"

    def make_snapshots(self, engine, haystacks: list[list[int]]) -> None:
        """The exact cache prefills every haystack whose snapshot is not in the folder yet and
        saves it."""
        if self.snapshot_dir is None:
            return
        todo = [ids for ids in haystacks if not self.snapshot_path(engine, ids).exists()]
        if not todo:
            return
        self.snapshot_dir.mkdir(parents=True, exist_ok=True)
        engine.reconfigure_kv(**EXACT_KNOBS)
        for ids in todo:
            path = self.snapshot_path(engine, ids)
            self.log(f"needles: exact prefill of a {len(ids)}-token haystack -> {path}")
            started = time.perf_counter()
            seq_id = engine.core.next_seq_id()
            engine.cache.add_sequence(seq_id)
            try:
                engine.forward_tokens(seq_id, ids)
                seconds = time.perf_counter() - started
                save_prefill(
                    engine.cache,
                    seq_id,
                    ids,
                    path,
                    engine_fingerprint(engine),
                    {"prefill_seconds": seconds, "made_by": "flashmemory eval --needles"},
                )
            finally:
                engine.cache.free_sequence(seq_id)
            self.snapshot_seconds[path.name] = seconds
            self.log(f"needles: {len(ids)} tokens prefilled in {seconds:.0f} s")

    def warm(self, engine, ids: list[int]) -> Warmed:
        """Put the haystack's KV into the current cache's prefix cache: its snapshot restored (every
        full chunk
        but the last), then the rest prefilled as a request (one token generated and dropped), whose
        full
        blocks the prefix cache names as it does any prompt's."""
        started = time.perf_counter()
        restored = 0
        if self.snapshot_dir is not None:
            seq_id = engine.core.next_seq_id()
            engine.cache.add_sequence(seq_id)
            try:
                restored, _ = restore_prefill(
                    engine.cache,
                    seq_id,
                    ids,
                    self.snapshot_path(engine, ids),
                    engine_fingerprint(engine),
                    engine.config.prefill_chunk_tokens,
                )
            finally:
                engine.cache.free_sequence(seq_id)  # its restored blocks stay in the prefix cache
        engine.generate_token_ids(ids, max_new_tokens=1, temperature=0.0)
        return Warmed(len(ids), restored, time.perf_counter() - started)
