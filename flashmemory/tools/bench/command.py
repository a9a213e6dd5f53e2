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
                   "2048 tokens); with --decode-only, the budget fm-mixed-budget runs under")
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
    p.add_argument("--decode-only", action="store_true",
                   help="the fair decode comparison: FlashMemory (8-bit and float32 activation dots) and llama.cpp "
                   "in persistent processes, same ids, teacher-forced steps in interleaved rounds, with each "
                   "engine's decode PPL and KL / top-1 against fm-exact (and llama.cpp q8_0 against llama.cpp f16) "
                   "over those steps (tools/bench/decode_compare.py); uses --model (a GGUF), --text, --lengths, "
                   "--threads, --json, and --engines: fm-* (no disk fraction; fm-mixed-budget with --budget-mb), "
                   "llamacpp-f16(-fa), llamacpp-q8_0-fa, hf-dynamic")
    p.add_argument("--rounds", type=int, default=3, help="--decode-only: interleaved rounds per length (3)")
    p.add_argument("--steps", type=int, default=16, help="--decode-only: teacher-forced steps per round (16)")
    p.add_argument("--fm-omp-wait-policy", default="PASSIVE",
                   choices=["ACTIVE", "PASSIVE", "default"],
                   help="--decode-only: OMP_WAIT_POLICY of FlashMemory's workers (PASSIVE: measured "
                   "best at one thread on a shared machine; default: OpenMP's own, spinning briefly "
                   "before sleeping, best at two threads; llama.cpp always runs with OpenMP's "
                   "default)")
    p.add_argument("--kv-snapshot", default=None, metavar="FILE",
                   help="--decode-only: start every engine from this snapshot (written by `flashmemory eval "
                   "--kv-snapshot` on the same --model and --text) instead of a prefill: the context but its last "
                   "prefill chunk is restored (llama.cpp through its sequence state as f16 or q8_0 rows, "
                   "transformers as a DynamicCache), that chunk and the decode steps are computed fresh; default "
                   "engines: fm-mixed, fm-exact, llama.cpp (f16 KV) at --threads and at 1 thread; default length: "
                   "the snapshot's tokens, capped to fit the decode steps")
    p.set_defaults(func=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    from flashmemory.tools.bench.config import BenchConfig, parse_length

    if args.decode_only:
        return _run_decode_compare(args, parse_length)

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


def _kv_budget(args: argparse.Namespace, checkpoint, max_seq_len: int):
    """With --budget-mb: the settings of a budgeted FlashMemory engine under that device-KV budget (its L0 arena,
    window and max_gpu_memory_mb for the weights as this engine holds them), for sequences of max_seq_len."""
    if args.budget_mb is None:
        return None
    import torch

    from flashmemory.model.loader import weights_bytes
    from flashmemory.tools.bench.device_budget import knobs_for_kv_budget

    weights = weights_bytes(checkpoint, "auto", torch.float32)
    return lambda base: knobs_for_kv_budget(checkpoint.config, "float32", int(args.budget_mb * 2**20), base,
                                            max_seq_len, weights).knobs


def _run_decode_compare(args: argparse.Namespace, parse_length) -> int:
    import json
    import os
    import tempfile

    from flashmemory.errors import ConfigError
    from flashmemory.tools.bench.decode_compare import (SNAPSHOT_CHUNK_TOKENS, check_snapshot, default_engines,
                                                        named_engines, run_decode_compare, snapshot_engines,
                                                        to_markdown)
    from flashmemory.model.loader import open_checkpoint
    from flashmemory.model.tokenizer import Tokenizer
    from flashmemory.tools.eval import default_text_path

    checkpoint = open_checkpoint(args.model)
    if checkpoint.format != "gguf":
        raise ConfigError("--decode-only compares engines on one GGUF: pass --model FILE.gguf (or none: SmolLM2)")
    text = Path(args.text) if args.text else default_text_path()
    if text is None:
        raise ConfigError("no --text given and ../shared/data/alice29.txt not found: pass a long text file")
    tokenizer = Tokenizer.from_checkpoint(checkpoint.path, checkpoint.config.eos_token_ids)
    ids = tokenizer.encode(Path(text).read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)
    limit = checkpoint.config.max_context_tokens - args.rounds * args.steps - 32
    snapshot = Path(args.kv_snapshot).expanduser() if args.kv_snapshot else None
    if snapshot is not None:  # checked whole here (model, tokens, SHA-256), so a worker never restores a bad one
        limit = min(limit, check_snapshot(snapshot, checkpoint, ids))
    lengths = [min(parse_length(x), limit) for x in args.lengths] if args.lengths else (
        [limit] if snapshot else [512, 2048, 8192])
    lengths = [min(n, limit) for n in lengths]
    while len(ids) < max(lengths) + args.rounds * args.steps + 1:  # a short text is repeated (+1: the last next id)
        ids = ids + ids
    threads = args.threads or min(8, len(os.sched_getaffinity(0)))
    fm_policy = None if args.fm_omp_wait_policy == "default" else args.fm_omp_wait_policy
    if args.engines:
        longest = max(lengths) + args.rounds * args.steps + 16
        engines = named_engines(args.engines, fm_policy, _kv_budget(args, checkpoint, longest))
    else:
        engines = (snapshot_engines(fm_policy, threads) if snapshot
                   else default_engines(fm_policy))
    with tempfile.TemporaryDirectory(prefix="fm-decode-") as tmp:
        ids_path = Path(tmp) / "ids.json"
        ids_path.write_text(json.dumps(ids))
        report = run_decode_compare(checkpoint.path, ids_path, lengths, args.rounds, args.steps, threads,
                                    engines, Path(tmp), log=lambda m: print(m, file=sys.stderr, flush=True),
                                    kv_snapshot=snapshot, restore_chunk_tokens=SNAPSHOT_CHUNK_TOKENS)
    markdown = to_markdown(report)
    print(markdown)
    if args.json:
        Path(args.json).write_text(json.dumps({**report, "markdown": markdown}, indent=1))
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _list_engines(config) -> int:
    import torch

    from flashmemory.tools.bench.engines import select_engines, unavailable_reason

    for spec in select_engines(config.engines):
        reason = unavailable_reason(spec, has_gguf=True, cuda_available=torch.cuda.is_available())
        print(f"{spec.name:22s} {reason or 'available'}  -- {spec.description}")
    return 0
