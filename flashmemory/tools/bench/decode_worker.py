"""A persistent decode worker: `python -m flashmemory.tools.bench.decode_worker SPEC.json` opens one engine,
prefills the context (or, with a KV snapshot, restores all of it but the last prefill chunk and prefills that
chunk), then answers commands on stdin with one JSON line each on stdout:

    {"cmd": "steps", "num": K}  -> {"ms": [K step times]}   K teacher-forced decode steps (the next ids)
    {"cmd": "quit"}             -> {"peak_rss_bytes": ...}  and exits

The llama.cpp worker never imports torch, so its peak RSS is llama.cpp's own (plus Python and numpy).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from flashmemory.errors import KVSnapshotError
from flashmemory.rss import peak_rss_bytes, reset_peak_rss

REPLY_PREFIX = "DECODE-REPLY "  # marks our lines among anything a library prints to stdout


class LlamaCppStepper:
    """llama.cpp (llama-cpp-python) fed the ids: eval() of one token per step, f16 KV, no flash attention."""

    def __init__(self, spec: dict[str, Any], num_ctx: int) -> None:
        import llama_cpp

        self.llm = llama_cpp.Llama(model_path=spec["gguf_path"], n_ctx=num_ctx, n_batch=512,
                                   n_threads=spec["threads"], n_threads_batch=spec["threads"],
                                   flash_attn=bool(spec.get("flash_attn", False)), logits_all=False, verbose=False)

    def warm_up(self, ids: list[int]) -> None:
        self.llm.eval(ids)
        self.llm.reset()  # the next eval overwrites every cell

    def feed(self, ids: list[int]) -> None:
        self.llm.eval(ids)

    def restore(self, snapshot: Path, context_ids: list[int], num_tokens: int) -> None:
        """The snapshot's KV of the first num_tokens into sequence 0 (tools/bench/llamacpp_state.py)."""
        from flashmemory.tools.bench.llamacpp_state import read_snapshot_kv, restore_into

        ids = context_ids[:num_tokens]
        snap_ids, keys, values = read_snapshot_kv(snapshot, num_tokens)
        if snap_ids != ids:
            raise KVSnapshotError(f"{snapshot} holds the KV of other tokens than the benchmark's; pass the --text "
                                  "the snapshot was made from")
        restore_into(self.llm, ids, keys, values)

    def close(self) -> None:
        self.llm.close()


class FlashMemoryStepper:
    """Our engine on one sequence, fed through the same path as teacher-forced scoring (engine/scoring.py)."""

    def __init__(self, spec: dict[str, Any], num_ctx: int) -> None:
        from flashmemory.engine.engine import FlashMemoryEngine

        self.engine = FlashMemoryEngine(model_path=spec["gguf_path"], num_threads=spec["threads"],
                                        max_seq_len=num_ctx, **spec.get("settings", {}))
        self.seq_id = -1

    def open(self) -> None:
        self.seq_id = self.engine.core.next_seq_id()
        self.engine.cache.add_sequence(self.seq_id)

    def warm_up(self, ids: list[int]) -> None:
        seq_id = self.engine.core.next_seq_id()
        self.engine.cache.add_sequence(seq_id)
        self.engine._forward(seq_id, ids)
        self.engine._forward(seq_id, ids[:1])
        self.engine.cache.free_sequence(seq_id, keep_cached=False)

    def feed(self, ids: list[int]) -> None:
        self.engine._forward(self.seq_id, ids)

    def restore(self, snapshot: Path, context_ids: list[int], num_tokens: int) -> None:
        """The snapshot's KV of the context but its last prefill chunk (num_tokens), through the cache's own write
        path, as `flashmemory eval` restores a prompt."""
        from flashmemory.engine.kv_snapshot import engine_fingerprint, model_identity, restore_prefill

        fingerprint = model_identity(engine_fingerprint(self.engine))
        chunk = self.engine.config.prefill_chunk_tokens
        restored, _ = restore_prefill(self.engine.cache, self.seq_id, context_ids, snapshot, fingerprint, chunk)
        if restored != num_tokens:
            raise KVSnapshotError(f"restored {restored} tokens, not {num_tokens}: the benchmark restores the context "
                                  f"but its last chunk of prefill_chunk_tokens ({chunk}); keep that setting at its "
                                  "default or pass a snapshot holding that many tokens")

    def close(self) -> None:
        self.engine.cache.free_sequence(self.seq_id, keep_cached=False)
        self.engine.close()


def _reply(payload: dict[str, Any]) -> None:
    sys.stdout.write(REPLY_PREFIX + json.dumps(payload) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    spec = json.loads(open(args[0]).read())
    ids = json.loads(Path(spec["ids_path"]).read_text())
    context = spec["context_tokens"]
    num_ctx = context + spec["max_steps"] + 16
    stepper = (LlamaCppStepper if spec["family"] == "llama.cpp" else FlashMemoryStepper)(spec, num_ctx)
    stepper.warm_up(ids[:16])  # kernels built, pools touched
    if isinstance(stepper, FlashMemoryStepper):
        stepper.open()
    restored = spec.get("restore_tokens", 0)
    start = time.perf_counter()
    if restored:
        stepper.restore(Path(spec["kv_snapshot"]), ids[:context], restored)
    restore_s = time.perf_counter() - start
    restore_peak = peak_rss_bytes()
    peak_reset = bool(restored) and reset_peak_rss()  # the peak from here on: without the restore's buffers
    start = time.perf_counter()
    stepper.feed(ids[restored:context])
    _reply({"prefill_s": time.perf_counter() - start, "restore_s": restore_s, "restored_tokens": restored,
            "restore_peak_rss_bytes": restore_peak, "peak_rss_reset": peak_reset})
    pos = context
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "quit":
            break
        times = []
        for _ in range(command["num"]):
            t0 = time.perf_counter()
            stepper.feed([ids[pos]])
            times.append((time.perf_counter() - t0) * 1e3)
            pos += 1
        _reply({"ms": times})
    stepper.close()
    _reply({"peak_rss_bytes": peak_rss_bytes()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
