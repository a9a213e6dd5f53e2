"""`flashmemory diagnose` on the command line: its flags and what running it does (heavy imports deferred)."""

from __future__ import annotations

import argparse
import json
import sys

from flashmemory.config_args import add_engine_flags, add_kv_flags, engine_kwargs
from flashmemory.errors import FlashMemoryError


def add_diagnose_command(sub: argparse._SubParsersAction) -> None:
    """Register `flashmemory diagnose` on the CLI's subcommands."""
    p = sub.add_parser(
        "diagnose", help="the memory pathway of a short measured run, stage by stage, with --advise what to change",
        description="Prefill a prompt and decode a few tokens with every part of the step timed, then report where "
        "each byte lives (weights, workspace, KV per level with its fragmentation), what moves between levels and "
        "how fast, the cold zone disk's measured speed, selection and prefetch, and where each millisecond of a "
        "step goes. --advise turns the findings into setting changes with the reason and the expected effect.")
    p.add_argument("model", nargs="?", default=None, help="GGUF file or HF folder (default: the embedded SmolLM2); "
                   "same as --model-path")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt-file", default=None, help="the prompt (UTF-8 text)")
    src.add_argument("--length", type=int, default=2048,
                     help="prompt tokens taken from a long text (../shared/data/alice29.txt, else the system's "
                     "licence texts), repeated when short (default 2048)")
    p.add_argument("--decode-tokens", type=int, default=32, help="greedy tokens decoded after the prompt (32)")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of text")
    p.add_argument("--chart", default=None, metavar="PNG", help="write a chart of bytes and milliseconds here")
    p.add_argument("--advise", action="store_true", help="add advice: concrete setting changes, why, what to expect")
    p.add_argument("--disk-seconds", type=float, default=1.0,
                   help="seconds per random-read pass of the cold zone disk probe (0 = do not probe)")
    add_engine_flags(p)
    add_kv_flags(p)
    p.set_defaults(func=run_diagnose_command)


def run_diagnose_command(args: argparse.Namespace) -> int:
    from flashmemory.engine.engine import FlashMemoryEngine
    from flashmemory.tools.diagnose import diagnose
    from flashmemory.tools.diagnose.chart import write_chart
    from flashmemory.tools.diagnose.text import render
    from flashmemory.tools.diagnose.workload import prompt_ids

    if args.decode_tokens < 2:
        raise FlashMemoryError("--decode-tokens must be at least 2 (the first token comes from the prefill)")
    kwargs = engine_kwargs(args)
    if args.model is not None and kwargs.get("model_path") not in (None, args.model):
        raise FlashMemoryError(f"two models given ({args.model!r} and --model-path {kwargs['model_path']!r})")
    kwargs["model_path"] = args.model or kwargs.get("model_path")
    text = None
    if args.prompt_file is not None:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise FlashMemoryError(f"cannot read --prompt-file {args.prompt_file!r}: {e.strerror}") from e
    engine = FlashMemoryEngine(**kwargs)
    try:
        ids = engine.tokenizer.encode(text) if text is not None else prompt_ids(engine, args.length)
        if not ids:
            raise FlashMemoryError("the prompt is empty")
        ids = ids[: max(1, engine.max_seq_len - args.decode_tokens - 1)]
        print(f"diagnose: {len(ids)} prompt tokens, {args.decode_tokens} decode tokens ...", file=sys.stderr)
        report = diagnose(engine, ids, args.decode_tokens, args.disk_seconds, with_advice=True)
    finally:
        engine.close()
    if args.chart:
        print(f"diagnose: chart written to {write_chart(report, args.chart)}", file=sys.stderr)
    if args.json:
        data = report.to_dict()
        if not args.advise:
            data.pop("advice")
        print(json.dumps(data, indent=2, default=str))
    else:
        print(render(report, with_advice=args.advise))
    return 0
