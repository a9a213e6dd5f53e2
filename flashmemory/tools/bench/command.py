"""`flashmemory bench` on the command line: its flags and what running it does (heavy imports deferred)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_bench_command(sub: argparse._SubParsersAction) -> None:
    """Register `flashmemory bench` on the CLI's subcommands."""
    p = sub.add_parser(
        "bench",
        help="memory, speed and fidelity side by side against transformers' caches and llama.cpp",
        description="Run FlashMemory's KV configurations and their peers on the same model, text and context "
        "lengths, interleaved (one process per run, medians); print a markdown table, optionally write JSON and "
        "PNG charts. Peers whose optional package is missing get a row saying what to install.",
    )
    p.add_argument("--model", default=None, help="GGUF or HF folder (default: the embedded SmolLM2; its GGUF feeds "
                   "llama.cpp, a dequantized safetensors copy FlashMemory and transformers)")
    p.add_argument("--text", default=None, help="long real text (default: ../shared/data/alice29.txt)")
    p.add_argument("--lengths", nargs="+", default=None, metavar="TOKENS",
                   help="context lengths, e.g. 512 2K 8K (default; capped below the model's limit)")
    p.add_argument("--runs", type=int, default=None, help="interleaved runs per engine and length (3)")
    p.add_argument("--engines", nargs="+", default=None, metavar="NAME",
                   help="engine names or families (flashmemory, transformers, llama.cpp); default: all but the "
                   "named-only ones (fm-contiguous, and the prefetch comparison fm-mixed-disk, fm-mixed-prefetch, "
                   "fm-mixed-prefetch-lru: name them to run them; a family means its default ones)")
    p.add_argument("--decode-tokens", type=int, default=None, help="greedy tokens decoded after each prompt (32)")
    p.add_argument("--fidelity-tokens", type=int, default=None,
                   help="teacher-forced tokens scored at the longest length against the exact cache (128; 0 = off)")
    p.add_argument("--budget-mb", type=float, default=None,
                   help="fixed device-KV budget in MiB for the longest-context column (default: an FP16 cache of "
                   "2048 tokens)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads of every engine (default: the cores "
                   "available, at most 8)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="model dtype of the torch engines (float32)")
    p.add_argument("--no-limit-run", dest="verify_limit", action="store_const", const=False, default=None,
                   help="do not run FlashMemory at the model's limit under the budget (computed only)")
    p.add_argument("--json", default=None, help="write every run, the medians and the tables here")
    p.add_argument("--charts-dir", default=None, help="write PNG charts here (needs matplotlib)")
    p.add_argument("--quick", action="store_true",
                   help="one short length (512), one run, 8 decode and 16 fidelity tokens: a couple of minutes")
    p.add_argument("--list-engines", action="store_true", help="list the engines and whether each can run here")
    p.add_argument("--from-json", default=None, metavar="PATH",
                   help="measure nothing: print the tables of a saved report again (--charts-dir draws its charts, "
                   "--json writes it back with the tables recomputed)")
    p.set_defaults(func=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    from flashmemory.tools.bench.config import BenchConfig, parse_length

    config = BenchConfig.create(
        quick=args.quick, model_path=args.model, text_path=Path(args.text) if args.text else None,
        lengths_tokens=tuple(parse_length(x) for x in args.lengths) if args.lengths else None, num_runs=args.runs,
        engines=tuple(args.engines) if args.engines else None, decode_tokens=args.decode_tokens,
        fidelity_tokens=args.fidelity_tokens, budget_mb=args.budget_mb, num_threads=args.threads, dtype=args.dtype,
        verify_limit=args.verify_limit, json_path=Path(args.json) if args.json else None,
        charts_dir=Path(args.charts_dir) if args.charts_dir else None,
    )
    if args.list_engines:
        return _list_engines(config)
    from flashmemory.tools.bench.charts import charts_unavailable_reason, write_charts
    from flashmemory.tools.bench.report import read_json, to_markdown, write_json
    from flashmemory.tools.bench.runner import run_bench

    if args.from_json:
        report = read_json(Path(args.from_json))
    else:
        report = run_bench(config, log=lambda m: print(m, file=sys.stderr, flush=True))
    markdown = to_markdown(report)
    print(markdown)
    if config.json_path:  # with --from-json: the same measurements, tables computed by this version
        write_json(report, config.json_path, markdown)
        print(f"wrote {config.json_path}", file=sys.stderr)
    if config.charts_dir:
        skipped = charts_unavailable_reason()
        if skipped:
            print(skipped, file=sys.stderr)
        else:
            for path in write_charts(report, config.charts_dir):
                print(f"wrote {path}", file=sys.stderr)
    return 0


def _list_engines(config) -> int:
    import torch

    from flashmemory.tools.bench.engines import select_engines, unavailable_reason

    for spec in select_engines(config.engines):
        reason = unavailable_reason(spec, has_gguf=True, cuda_available=torch.cuda.is_available())
        print(f"{spec.name:22s} {reason or 'available'}  -- {spec.description}")
    return 0
