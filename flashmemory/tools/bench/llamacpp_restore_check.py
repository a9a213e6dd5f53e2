"""Does our KV, restored into llama.cpp, decode as llama.cpp's own prefill does?

    python -m flashmemory.tools.bench.llamacpp_restore_check --tokens 2048 [--kv-type q8_0] [--model GGUF]

For the first N - 1 tokens of the text: llama.cpp prefills them and decodes STEPS teacher-forced steps (the
reference); our exact FP16 cache prefills them and writes a KV snapshot; llama.cpp restores that snapshot
(llamacpp_state.py) and decodes the same steps. Prints max |Δlogit| between the two, the two engines' own gap
(our decode log-softmax against llama.cpp's), llama.cpp's own state restored through the same path (0.0 when the
layout is right) and a wrong layout (keys in the other RoPE pairing) as the control. --kv-type q8_0: llama.cpp's
cache in q8_0 (K and V, flash attention on, as llama.cpp requires for a quantized V), our FP16 KV quantized to it.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from flashmemory.tools.bench import llamacpp_state as state
from flashmemory.tools.bench.llamacpp_open import open_llama


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - np.logaddexp.reduce(x, axis=-1, keepdims=True)


def main(argv: list[str] | None = None) -> int:
    import llama_cpp

    from flashmemory.engine.engine import FlashMemoryEngine
    from flashmemory.model.long_model import long_model_path

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=512, help="N: N - 1 tokens restored, then STEPS decoded")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--model", default=None, help="a qwen2 or llama GGUF (default: the 32K model)")
    p.add_argument("--text", default="../shared/data/lcet10.txt")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-type", default="f16", choices=["f16", "q8_0"], help="llama.cpp's K and V cache type")
    args = p.parse_args(argv)
    n, model = args.tokens, Path(args.model) if args.model else long_model_path()
    kv_type = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0}[args.kv_type]
    llm = open_llama(model_path=str(model), n_ctx=n + args.steps + 16, n_batch=512,
                     n_threads=args.threads,
                          n_threads_batch=args.threads, type_k=kv_type, type_v=kv_type,
                          flash_attn=args.kv_type != "f16", logits_all=False, verbose=False)
    ids = llm.tokenize(Path(args.text).read_bytes(), add_bos=False)[:n + args.steps - 1]

    def decode() -> np.ndarray:  # [steps, vocab]: positions n - 1 ... n + steps - 2
        rows = []
        for pos in range(n - 1, len(ids)):
            llm.eval([ids[pos]])
            rows.append(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1),
                                              shape=(llm.n_vocab(),)).copy())
        return np.stack(rows)

    start = time.perf_counter()
    llm.eval(ids[:n - 1])
    own_bytes = state.sequence_bytes(llm)
    own = state.decode_state(own_bytes)
    byte_equal = state.encode_state(own).tobytes() == own_bytes
    real = decode()
    print(f"llama.cpp prefill of {n - 1} tokens: {time.perf_counter() - start:.1f} s")
    with tempfile.TemporaryDirectory() as tmp:
        engine = FlashMemoryEngine(model_path=str(model), kv_cache="contiguous", kv_precision="fp16",
                                   num_threads=args.threads)
        ours = engine.score_tokens(ids, num_teacher_forced=args.steps, kv_snapshot=Path(tmp) / "s.kvsnap")
        engine.close()
        snap_ids, keys, values = state.read_snapshot_kv(Path(tmp) / "s.kvsnap", n - 1)
    assert snap_ids == ids[:n - 1]
    heads = keys.shape[1]

    def ours_layout(rows: np.ndarray) -> np.ndarray:  # llama.cpp rows -> [layers, heads, tokens, head_dim]
        width = rows.shape[2]
        return rows.reshape(rows.shape[0], rows.shape[1], heads, width // heads).transpose(0, 2, 1, 3)

    if args.kv_type == "f16":  # through our layout and back
        state.restore_into(llm, ids[:n - 1], ours_layout(own.keys), ours_layout(own.values))
    else:  # its q8_0 blocks as they are (dequantized to fp16 and quantized again they would not be the same)
        state.write_state(llm, own, ids[:n - 1])
    own_restored = decode()
    state.restore_into(llm, snap_ids, keys, values)
    restored = decode()
    diff = np.abs(restored - real)
    gap = np.abs(ours.decode_logprobs.double().numpy() - _log_softmax(real)[:-1]).max()
    print(f"n={n}: llama.cpp's own state ({len(own_bytes)} bytes) decoded and re-encoded byte for byte: {byte_equal}")
    print(f"n={n}: its own KV restored vs its prefill: max |dlogit| {np.abs(own_restored - real).max():.4g}")
    print(f"n={n}: our KV restored vs its prefill, {len(real)} steps: max |dlogit| {diff.max():.4g}, mean "
          f"{diff.mean():.3g}, top-1 {(restored.argmax(1) == real.argmax(1)).sum()}/{len(real)}")
    print(f"n={n}: the engines' own gap (our log-softmax vs llama.cpp's): max {gap:.4g}")
    if args.kv_type != "f16":  # a control: our q8_0 rows without llama.cpp's Hadamard rotation
        rotation_sizes = state.rotation_sizes
        state.rotation_sizes = lambda head_dim, ggml_type: (0, 0)
        state.restore_into(llm, snap_ids, keys, values)
        unrotated = decode()
        state.rotation_sizes = rotation_sizes
        print(f"n={n}: control, q8_0 rows not rotated: max |dlogit| {np.abs(unrotated - real).max():.4g}, top-1 "
              f"{(unrotated.argmax(1) == real.argmax(1)).sum()}/{len(real)}")
    arch = llm.metadata.get("general.architecture", "")
    state.ROPE_INTERLEAVED[arch] = not state.ROPE_INTERLEAVED[arch]  # the control: the other pairing
    state.restore_into(llm, snap_ids, keys, values)
    wrong = decode()
    print(f"n={n}: control, keys in the wrong RoPE pairing: max |dlogit| {np.abs(wrong - real).max():.4g}, top-1 "
          f"{(wrong.argmax(1) == real.argmax(1)).sum()}/{len(real)}")
    llm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
