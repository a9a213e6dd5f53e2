"""weights_dtype on a GPU: bfloat16 against torchao's int8 (q8_0) and int4 (q4_0) weight-only projections.

For each model (the embedded SmolLM2, and the 32K Qwen2.5-Coder-0.5B GGUF when it is present) and each setting:
the prompt's logits (one forward; max |dlogit| and top-1 agreement against bfloat16), the greedy continuation
(tokens equal to bfloat16's, first divergence), the weights' bytes (measured and the pre-load estimate), peak
device memory, and decode tok/s (median of --runs generations of --decode-tokens tokens after one warm-up).
Every setting runs fm-exact's cache (contiguous, FP16 KV), so the differences are the weights' alone.

    PYTHONPATH=. .venv/bin/python bench/cuda_weights_check.py --json cuda_weights_check.json

About 1-3 minutes on one recent GPU (mostly loading; the 32K model's K-quants are dequantized on the CPU).
On a host without CUDA it says so and exits with status 2: there is nothing to measure on a CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

SETTINGS = ("bfloat16", "q8_0", "q4_0")
PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
          "movable metal type, oil-based ink and a wooden screw press. Within fifty years")
ENGINE_KNOBS = {"device": "cuda", "dtype": "bfloat16", "kv_cache": "contiguous", "kv_precision": "fp16",
                "max_num_seqs": 1, "max_seq_len": 1024}


def models() -> list[tuple[str, str | None]]:
    """(label, path) of the models to check: the embedded default (path None), the long GGUF if fetched."""
    from flashmemory.errors import ModelNotFoundError
    from flashmemory.model.long_model import long_model_path

    out: list[tuple[str, str | None]] = [("SmolLM2-135M (default)", None)]
    try:
        out.append(("Qwen2.5-Coder-0.5B (32K GGUF)", str(long_model_path())))
    except ModelNotFoundError as e:
        print(f"skipping the 32K model: {e}", file=sys.stderr)
    return out


def check_setting(model_path: str | None, weights_dtype: str, decode_tokens: int, runs: int) -> dict[str, Any]:
    """Load one engine, measure it, and give back its figures plus the logits and tokens to compare."""
    from flashmemory import FlashMemoryEngine
    from flashmemory.model.loader import open_checkpoint, weights_bytes

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    engine = FlashMemoryEngine(model_path=model_path, weights_dtype=weights_dtype, **ENGINE_KNOBS)
    load_s = time.perf_counter() - started
    try:
        ids = engine.tokenizer.encode(PROMPT)
        logits = engine.prompt_logits(ids).float().cpu()  # [T, vocab]
        greedy = engine.generate_token_ids(ids, max_new_tokens=decode_tokens, ignore_eos=True)
        rates = []
        for _ in range(runs):
            engine.generate_token_ids(ids, max_new_tokens=decode_tokens, ignore_eos=True)
            rates.append(engine.last_stats.decode_tokens_per_s)
        estimate = weights_bytes(open_checkpoint(model_path), weights_dtype, engine.dtype, engine.device)
        return {"weights_dtype": weights_dtype, "load_s": load_s, "weights_bytes": engine.weights_bytes,
                "weights_bytes_estimate": estimate, "peak_device_bytes": torch.cuda.max_memory_allocated(),
                "decode_tok_s": statistics.median(rates), "decode_tok_s_runs": rates,
                "prompt_tokens": len(ids), "logits": logits, "greedy": greedy}
    finally:
        engine.close()
        del engine


def compare(row: dict[str, Any], ref_logits: torch.Tensor, ref_greedy: list[int]) -> None:
    """Replace the row's logits by their differences from bfloat16's, and add its greedy tokens' agreement."""
    a, b = row.pop("logits"), ref_logits
    row["max_abs_dlogit"] = (a - b).abs().max().item()
    row["max_abs_logit"] = b.abs().max().item()
    row["prompt_top1_agreement"] = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    ours, ref = row["greedy"], ref_greedy
    row["greedy_equal"] = sum(x == y for x, y in zip(ours, ref))
    row["greedy_first_divergence"] = next((i for i, (x, y) in enumerate(zip(ours, ref)) if x != y), None)


def to_markdown(report: dict[str, Any]) -> str:
    lines = ["| model | weights_dtype | weights MiB (estimate) | peak device MiB | max abs dlogit (max logit) | "
             "prompt top-1 = bf16 | greedy = bf16 (first diff) | decode tok/s (median) | load s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(
            f"| {r['model']} | {r['weights_dtype']} | {r['weights_bytes'] / 2**20:.1f} "
            f"({r['weights_bytes_estimate'] / 2**20:.1f}) | {r['peak_device_bytes'] / 2**20:.0f} | "
            f"{r['max_abs_dlogit']:.3f} ({r['max_abs_logit']:.1f}) | {r['prompt_top1_agreement']:.1%} | "
            f"{r['greedy_equal']}/{len(r['greedy'])} ({r['greedy_first_divergence']}) | {r['decode_tok_s']:.1f} | "
            f"{r['load_s']:.1f} |")
    lines.append("")
    lines.append(f"{report['device']}; torch {report['torch']}, torchao {report['torchao']}; prompt of "
                 f"{report['rows'][0]['prompt_tokens']} tokens (SmolLM2's tokenizer), {report['decode_tokens']} greedy "
                 f"tokens, decode tok/s the median of {report['runs']} runs; fm-exact's cache (contiguous, FP16 KV).")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--decode-tokens", type=int, default=64, help="greedy tokens per generation")
    p.add_argument("--runs", type=int, default=5, help="timed generations per setting (the median is reported)")
    p.add_argument("--json", type=Path, help="write the report here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print(f"cuda_weights_check: no CUDA device (torch {torch.__version__}, CUDA build: {torch.version.cuda}); "
              "weights_dtype q8_0/q4_0 go through torchao on a GPU only, so there is nothing to measure here. Run "
              "it on a GPU host: PYTHONPATH=. python bench/cuda_weights_check.py --json cuda_weights_check.json",
              file=sys.stderr)
        return 2
    from flashmemory.model.cuda_weights import torchao_version

    rows: list[dict[str, Any]] = []
    for label, path in models():
        measured = {s: check_setting(path, s, args.decode_tokens, args.runs) for s in SETTINGS}
        ref_logits, ref_greedy = measured["bfloat16"]["logits"], measured["bfloat16"]["greedy"]
        for setting in SETTINGS:
            compare(measured[setting], ref_logits, ref_greedy)
            rows.append({"model": label, **measured[setting]})
            print(f"{label} {setting}: {rows[-1]['decode_tok_s']:.1f} tok/s, max |dlogit| "
                  f"{rows[-1]['max_abs_dlogit']:.3f}", file=sys.stderr, flush=True)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "torchao": torchao_version(),
              "decode_tokens": args.decode_tokens, "runs": args.runs, "rows": rows,
              "finished": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    markdown = to_markdown(report)
    print(markdown)
    if args.json:
        args.json.write_text(json.dumps({**report, "markdown": markdown}, indent=1))
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
