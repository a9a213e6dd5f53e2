"""A persistent decode worker: `python -m flashmemory.tools.bench.decode_worker SPEC.json` opens one engine,
prefills the context (or, with a KV snapshot, restores all of it but the last prefill chunk and prefills that
chunk), then answers commands on stdin with one JSON line each on stdout:

    {"cmd": "steps", "num": K, "logprobs_path": P} -> {"ms": [K step times]}   K teacher-forced decode steps (the
        next ids); each step's log-softmax (float32, full vocabulary) saved to P as [K, vocab] (decode_fidelity.py)
    {"cmd": "quit"}             -> {"peak_rss_bytes": ..., "kv_bytes": {...}}  and exits

Only the step itself is timed: reading its logits out and their log-softmax come after the clock stops. The
llama.cpp worker never imports torch, so its peak RSS is llama.cpp's own (plus Python and numpy); transformers'
stepper lives in hf_decode_stepper.py.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from flashmemory.errors import ConfigError, KVSnapshotError
from flashmemory.rss import peak_rss_bytes, reset_peak_rss
from flashmemory.tools.bench.decode_fidelity import log_softmax
from flashmemory.tools.bench.llamacpp_open import open_llama

REPLY_PREFIX = "DECODE-REPLY "  # marks our lines among anything a library prints to stdout


class LlamaCppStepper:
    """llama.cpp (llama-cpp-python) fed the ids: eval() of one token per step; f16 KV without flash attention by
    default, or settings {"kv_type": "f16" | "q8_0", "flash_attn": bool} (a q8_0 V cache needs flash attention)."""

    def __init__(self, spec: dict[str, Any], num_ctx: int) -> None:
        import llama_cpp

        settings = spec.get("settings", {})
        self.kv_type = settings.get("kv_type", "f16")
        types = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0}
        if self.kv_type not in types:
            raise ConfigError(f"the decode comparison runs llama.cpp with f16 or q8_0 KV, not {self.kv_type!r}")
        self.llm = open_llama(model_path=spec["gguf_path"], n_ctx=num_ctx, n_batch=512,
                                   n_threads=spec["threads"], n_threads_batch=spec["threads"],
                                   type_k=types[self.kv_type], type_v=types[self.kv_type],
                                   flash_attn=bool(settings.get("flash_attn", False)), logits_all=False,
                                   verbose=False)
        self._get_logits = llama_cpp.llama_get_logits_ith

    def open(self) -> None:
        pass

    def last_logprobs(self) -> np.ndarray:
        logits = np.ctypeslib.as_array(self._get_logits(self.llm.ctx, -1), shape=(self.llm.n_vocab(),))
        return log_softmax(logits)

    def kv_bytes(self) -> dict[str, int]:
        """llama.cpp's K and V buffers as allocated: every one of its n_ctx cells (kv_bytes.py)."""
        from flashmemory.tools.bench.kv_bytes import llama_cpp_kv_bytes

        md = self.llm.metadata
        arch = md.get("general.architecture", "llama")
        heads = int(md[f"{arch}.attention.head_count"])
        head_dim = int(md.get(f"{arch}.attention.key_length", int(md[f"{arch}.embedding_length"]) // heads))
        width = int(md[f"{arch}.attention.head_count_kv"]) * head_dim
        kv = llama_cpp_kv_bytes(self.kv_type, self.kv_type, self.llm.n_ctx(), int(md[f"{arch}.block_count"]), width)
        return {"device": kv, "host": 0, "disk": 0}

    def warm_up(self, ids: list[int]) -> None:
        self.llm.eval(ids)
        self.llm.reset()  # the next eval overwrites every cell

    def feed(self, ids: list[int]) -> None:
        self.llm.eval(ids)

    def restore(self, snapshot: Path, context_ids: list[int], num_tokens: int) -> None:
        """The snapshot's KV of the first num_tokens into sequence 0 (tools/bench/llamacpp_state.py)."""
        from flashmemory.tools.bench.llamacpp_state import read_snapshot_kv, restore_into

        ids = context_ids[:num_tokens]
        _, keys, values = read_snapshot_kv(snapshot, num_tokens, expected_ids=ids)
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
        self._logits = None  # [1, vocab] of the latest feed

    def last_logprobs(self) -> np.ndarray:
        return log_softmax(self._logits[-1].float().cpu().numpy())

    def kv_bytes(self) -> dict[str, int]:
        """The cache's own counters as the sequence stands (fm_worker.kv_bytes: the L0 arena is the device's)."""
        from flashmemory.tools.bench.fm_worker import kv_bytes

        counted = kv_bytes(dict(self.engine.cache.stats()))
        return {"device": counted["device"], "host": counted["host"], "disk": counted["disk"]}

    def open(self) -> None:
        self.seq_id = self.engine.core.next_seq_id()
        self.engine.cache.add_sequence(self.seq_id)

    def warm_up(self, ids: list[int]) -> None:
        seq_id = self.engine.core.next_seq_id()
        self.engine.cache.add_sequence(seq_id)
        self.engine.forward_tokens(seq_id, ids)
        self.engine.forward_tokens(seq_id, ids[:1])
        self.engine.cache.free_sequence(seq_id, keep_cached=False)

    def feed(self, ids: list[int]) -> None:
        self._logits = self.engine.forward_tokens(self.seq_id, ids)

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


def open_stepper(spec: dict[str, Any], num_ctx: int):
    """The stepper of the spec's engine family."""
    if spec["family"] == "llama.cpp":
        return LlamaCppStepper(spec, num_ctx)
    if spec["family"] == "transformers":
        from flashmemory.tools.bench.hf_decode_stepper import TransformersStepper

        return TransformersStepper(spec, num_ctx)
    return FlashMemoryStepper(spec, num_ctx)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    spec = json.loads(open(args[0]).read())
    ids = json.loads(Path(spec["ids_path"]).read_text())
    context = spec["context_tokens"]
    num_ctx = context + spec["max_steps"] + 16
    stepper = open_stepper(spec, num_ctx)
    stepper.warm_up(ids[:16])  # kernels built, pools touched
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
        times, rows = [], []
        for _ in range(command["num"]):
            t0 = time.perf_counter()
            stepper.feed([ids[pos]])
            times.append((time.perf_counter() - t0) * 1e3)
            rows.append(stepper.last_logprobs())  # after the clock: not part of the step's time
            pos += 1
        if command.get("logprobs_path"):
            np.save(command["logprobs_path"], np.stack(rows))  # [num, vocab] float32
        _reply({"ms": times})
    kv = stepper.kv_bytes()
    stepper.close()
    _reply({"peak_rss_bytes": peak_rss_bytes(), "kv_bytes": kv})
    return 0


if __name__ == "__main__":
    sys.exit(main())
