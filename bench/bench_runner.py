"""Benchmark: FlashMemory's runner vs Hugging Face transformers' `generate` on the same weights.

Each measurement runs in a fresh subprocess (so peak RSS is per engine), engines interleaved A B A B ...
so machine drift hits both alike; the table reports medians and the ratio ours / transformers.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/bench_runner.py --lengths 512 2048 --runs 3

The GGUF is dequantized once (by our loader, checked against transformers in the tests) into a safetensors folder in the FlashMemory cache, and both
engines load that folder: same weights, same tokenizer, same dtype.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TEXT = REPO.parent / "shared" / "data" / "alice29.txt"
ENGINES = ("flashmemory", "transformers")


def export_folder(model: str | None) -> Path:
    """A safetensors copy of the model (exported once by transformers); a folder model is used as is."""
    from flashmemory.model.default_model import default_model_path
    from flashmemory.model.tokenizer import cache_root, file_fingerprint

    path = Path(model) if model else default_model_path()
    if path.is_dir():
        return path
    out = cache_root() / "hf-export" / file_fingerprint(path)
    if (out / "config.json").is_file():
        return out
    from flashmemory.model.export import export_safetensors
    from flashmemory.model.loader import open_checkpoint

    print(f"exporting {path.name} to {out} (once)", file=sys.stderr)
    return export_safetensors(open_checkpoint(path), out)


def prompt_ids(tokenizer, text_path: Path, length: int) -> list[int]:
    ids = tokenizer.encode(text_path.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)
    if len(ids) < length:
        raise SystemExit(f"{text_path} has only {len(ids)} tokens; need {length}")
    return ids[:length]


def worker(engine: str, folder: Path, text: Path, length: int, decode_tokens: int, dtype: str, kv_cache: str) -> dict:
    """One measurement in this process: prefill `length` tokens, then decode `decode_tokens` greedily."""
    import torch

    if engine == "flashmemory":
        from flashmemory import FlashMemoryEngine

        eng = FlashMemoryEngine(model_path=str(folder), dtype=dtype, kv_cache=kv_cache)
        ids = prompt_ids(eng.tokenizer.hf, text, length)
        eng.generate_token_ids(ids[:16], max_new_tokens=2, ignore_eos=True)  # warm-up
        eng.generate_token_ids(ids, max_new_tokens=decode_tokens, ignore_eos=True)
        s = eng.last_stats
        prefill_s, decode_s, n = s.prefill_seconds, s.decode_seconds, s.num_generated_tokens
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.generation.streamers import BaseStreamer

        tok = AutoTokenizer.from_pretrained(str(folder))
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, dtype)).eval()
        ids = prompt_ids(tok, text, length)

        class Clock(BaseStreamer):
            def __init__(self) -> None:
                self.times: list[float] = []

            def put(self, value) -> None:
                self.times.append(time.perf_counter())

            def end(self) -> None:
                pass

        def run(n_prompt: int, n_new: int) -> tuple[float, float, int]:
            clock = Clock()
            start = time.perf_counter()
            with torch.inference_mode():
                model.generate(torch.tensor([ids[:n_prompt]]), max_new_tokens=n_new, min_new_tokens=n_new,
                               do_sample=False, streamer=clock, pad_token_id=tok.eos_token_id)
            # put() #0 is the prompt, #1 the first generated token, then one per decode step.
            return clock.times[1] - start, clock.times[-1] - clock.times[1], len(clock.times) - 1

        run(16, 2)  # warm-up
        prefill_s, decode_s, n = run(length, decode_tokens)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "engine": engine, "length": length, "dtype": dtype, "threads": torch.get_num_threads(),
        "prefill_tok_s": length / prefill_s, "ttft_s": prefill_s,
        "decode_tok_s": (n - 1) / decode_s, "decode_tokens": n, "peak_rss_bytes": rss,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF or HF folder (default: embedded SmolLM2)")
    ap.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    ap.add_argument("--kv-cache", default="contiguous", choices=["contiguous", "tiered"],
                    help="FlashMemory's KV cache (default: the exact contiguous one, same work as transformers)")
    ap.add_argument("--json", type=Path, default=None, help="write all runs and medians here")
    ap.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    ap.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        result = worker(args.worker, args.folder, args.text, args.lengths[0], args.decode_tokens, args.dtype,
                        args.kv_cache)
        print(json.dumps(result))
        return
    if not args.text.is_file():
        raise SystemExit(f"text {args.text} not found: pass --text FILE (long English prose)")
    folder = export_folder(args.model)
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    runs: list[dict] = []
    for length in args.lengths:
        for r in range(args.runs):
            for engine in args.engines:  # interleaved: A B A B ...
                cmd = [sys.executable, __file__, "--worker", engine, "--folder", str(folder), "--text", str(args.text),
                       "--lengths", str(length), "--decode-tokens", str(args.decode_tokens), "--dtype", args.dtype,
                       "--kv-cache", args.kv_cache]
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if proc.returncode != 0:
                    raise SystemExit(f"{engine} at {length} tokens failed:\n{proc.stderr[-3000:]}")
                result = json.loads(proc.stdout.strip().splitlines()[-1])
                runs.append(result)
                print(f"  run {r + 1}/{args.runs} {engine:12s} {length:5d} tok: prefill {result['prefill_tok_s']:.0f} "
                      f"tok/s, decode {result['decode_tok_s']:.2f} tok/s, peak RSS "
                      f"{result['peak_rss_bytes'] / 2**20:.0f} MiB", file=sys.stderr)
    summary = summarize(runs, args)
    print(summary["markdown"])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"runs": runs, **summary}, indent=2))


def summarize(runs: list[dict], args: argparse.Namespace) -> dict:
    rows, medians = [], {}
    for length in args.lengths:
        for engine in args.engines:
            sel = [r for r in runs if r["engine"] == engine and r["length"] == length]
            medians[(engine, length)] = {k: statistics.median(r[k] for r in sel)
                                         for k in ("prefill_tok_s", "ttft_s", "decode_tok_s", "peak_rss_bytes")}
    head = ("| context | engine | prefill tok/s | TTFT s | decode tok/s | peak RSS MiB | decode vs transformers |\n"
            "|---:|---|---:|---:|---:|---:|---:|")
    for length in args.lengths:
        base = medians.get(("transformers", length))
        for engine in args.engines:
            m = medians[(engine, length)]
            ratio = f"{m['decode_tok_s'] / base['decode_tok_s']:.2f}x" if base else "n/a"
            rows.append(f"| {length} | {engine} | {m['prefill_tok_s']:.0f} | {m['ttft_s']:.2f} | "
                        f"{m['decode_tok_s']:.2f} | {m['peak_rss_bytes'] / 2**20:.0f} | {ratio} |")
    import torch

    meta = (f"dtype {args.dtype}, FlashMemory kv_cache={args.kv_cache}, {args.decode_tokens} decode tokens, median of {args.runs} runs, "
            f"torch {torch.__version__} threads {runs[0]['threads']}, {platform.processor() or platform.machine()}, "
            f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'PASSIVE')}")
    return {"markdown": head + "\n" + "\n".join(rows) + "\n\n" + meta,
            "medians": {f"{e}@{n}": m for (e, n), m in medians.items()}}


if __name__ == "__main__":
    main()
