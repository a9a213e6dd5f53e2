"""The `flashmemory` command: generate, eval, bench, serve, trace, train-predictor, diagnose and doctor (nothing imports
it)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from flashmemory.config import EngineConfig
from flashmemory.config_args import add_engine_flags, add_flags, add_kv_flags, engine_kwargs
from flashmemory.tools.bench.command import add_bench_command
from flashmemory.tools.diagnose.command import add_diagnose_command
from flashmemory.tools.doctor.command import add_doctor_command
from flashmemory.tools.needles.command import add_needle_flags, run_needles
from flashmemory.errors import FlashMemoryError
from flashmemory.kvcache.kv_stats import KVStats
from flashmemory.serve.args import add_serve_args

EXIT_ERROR = 1
EXIT_USAGE = 2


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="stream a completion (or a chat answer with --chat) from a model",
        description="Stream a completion to stdout; a one-line summary (prompt tokens, time to first token, "
        "decode tokens/s, peak memory) goes to stderr.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="read the prompt from this file")
    p.add_argument("--chat", action="store_true", help="treat the prompt as a user message and apply the chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default; so is anything below 1e-5); at most 3.4e38 (float32's largest)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus, in [1.2e-38, 1] (smaller is 0 in float32)")
    p.add_argument("--top-k", type=int, default=0, help="0 = no limit")
    p.add_argument("--seed", type=int, default=None, help="0 <= seed < 2**64")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stats", action="store_true", help="print the KV levels' bytes, blocks and traffic to stderr")
    add_engine_flags(p)
    add_kv_flags(p)
    p.set_defaults(func=_run_generate)


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return args.prompt
    if args.prompt_file is not None:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                return f.read()
        except OSError as e:
            raise FlashMemoryError(f"cannot read --prompt-file {args.prompt_file!r}: {e.strerror}") from e
        except UnicodeDecodeError as e:
            raise FlashMemoryError(f"--prompt-file {args.prompt_file!r} is not UTF-8 text ({e.reason})") from e
    if sys.stdin.isatty():
        raise FlashMemoryError("no prompt: give --prompt TEXT, --prompt-file FILE, or pipe text on stdin")
    return sys.stdin.read()


def _run_generate(args: argparse.Namespace) -> int:
    from flashmemory.engine.engine import FlashMemoryEngine
    from flashmemory.engine.sampling import SamplingParams

    prompt = _read_prompt(args)
    if not prompt.strip():
        raise FlashMemoryError("the prompt is empty")
    if args.system is not None and not args.chat:
        raise FlashMemoryError("--system only applies with --chat")
    # Validate sampling before the (slow) model load, so a typo fails in milliseconds.
    params = dict(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, stop=tuple(args.stop),
    )
    SamplingParams(**params)
    engine = FlashMemoryEngine(**engine_kwargs(args))
    bar = _prefill_bar(engine) if sys.stderr.isatty() else None
    if bar is not None:
        params["progress"] = bar
    try:
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system is not None else [])
            messages.append({"role": "user", "content": prompt})
            pieces = engine.stream_chat(messages, **params)
        else:
            pieces = engine.stream(prompt, **params)
        for piece in pieces:
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
        print(engine.last_stats.summary(), file=sys.stderr)
        if args.stats:
            print(format_kv_stats(engine.last_kv_snapshot), file=sys.stderr)
            if engine.speculator is not None:
                s = engine.speculator.stats
                print(f"speculative {engine.speculator.proposer.name}: "
                      f"{s.spec_decode_accepted_tokens} of {s.spec_decode_draft_tokens} drafted "
                      f"tokens kept ({s.spec_decode_acceptance_rate:.0%}) in "
                      f"{s.spec_decode_num_drafts} verifications", file=sys.stderr)
    finally:
        if bar is not None:
            bar.close()
        engine.close()  # the cold-zone file goes now, also on Ctrl-C or an error mid-generation
    return 0


class _prefill_bar:  # noqa: N801 - used like a function: _prefill_bar(engine) -> callable
    """A tqdm bar over a long prompt's prefill, drawn only once it takes more than one chunk."""

    def __init__(self, engine) -> None:
        self.chunk = engine.config.prefill_chunk_tokens
        self.bar = None

    def __call__(self, done: int, total: int) -> None:
        if total <= self.chunk:
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="tok", desc="prefill", leave=False, file=sys.stderr)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def format_kv_stats(stats: KVStats | None) -> str:
    """One line per level: blocks and bytes used of capacity; then traffic and selection."""
    if stats is None:
        return ""
    lines = []
    for lv in stats.levels:
        name = f"{lv.label} {lv.name}"
        lines.append(f"{name:10s} {lv.blocks:6d} blocks  {lv.bytes / 2**20:9.2f} MiB "
                     f"of {lv.bytes_capacity / 2**20:.1f} MiB")
    moved = ", ".join(f"{m.route} {m.bytes / 2**20:.1f} MiB" for m in stats.moves)
    if moved:
        lines.append(f"moved      {moved}")
    sel = [f"{lv.label} {lv.selected_fraction:.1%}" for lv in stats.levels
           if lv.selected_fraction is not None and lv.candidate_blocks]
    if sel:
        lines.append(f"selected   {', '.join(sel)} of candidate blocks per decode step")
    elif any(lv.selected_fraction is not None for lv in stats.levels):
        lines.append("selected   nothing to select: all KV was still in L0")
    p = stats.prefetch
    if p is not None:
        lookups = p.prefetch_hits + p.prefetch_misses
        wasted = p.prefetch_wasted_bytes / 2**20
        lines.append(f"prefetch   L2 hit rate {p.prefetch_hit_rate:.1%} of {lookups} segment "
                     f"reads, {p.prefetch_issued} read ahead, {wasted:.2f} MiB "
                     f"wasted; ranker {p.predictor_ms:.2f} ms, all step-end work "
                     f"{p.prefetch_ranking_ms:.2f} ms per decode step")
    st = stats.staging
    if st is not None:
        reads = st.device_staging_hits + st.device_staging_misses
        rate = st.device_staging_hits / reads if reads else 0.0
        lines.append(f"staging    L1 on device: hit rate {rate:.1%} of {reads} block reads, "
                     f"{st.device_staging_bytes / 2**20:.2f} MiB of "
                     f"{st.device_staging_capacity_bytes / 2**20:.1f} MiB")
    if stats.contiguous is not None:
        lines.append(f"KV (contiguous) {stats.contiguous.kv_bytes_used / 2**20:.2f} MiB")
    return "\n".join(lines)


def _add_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="fidelity of KV configurations against the exact cache (perplexity, KL, top-1, passkey; --needles: retrieval suite)",
        description="Score a long text with the exact FP16 contiguous cache and each configuration; print a "
        "table and optionally write JSON.",
    )
    p.add_argument("text", nargs="?", default=None, help="long text file (default: ../shared/data/alice29.txt)")
    p.add_argument("--window-tokens", type=int, default=8192, help="tokens of text scored (capped by the model)")
    p.add_argument("--decode-tokens", type=int, default=128, help="last tokens fed one at a time (teacher forcing)")
    p.add_argument("--config", action="append", default=[], metavar="NAME:key=value,...",
                   help="a configuration to compare (repeatable); default: mixed, mixed-warm1024, mixed-cold, "
                   "mixed-all-blocks")
    p.add_argument("--passkey-depths", type=float, nargs="*", default=[0.1, 0.5, 0.9])
    p.add_argument("--passkey-tokens", type=int, default=1500)
    p.add_argument("--passkey-window", type=int, default=256, help="active_window/warm_tokens for the passkey runs")
    p.add_argument("--text", dest="text_option", default=None, help="the long text (same as the positional)")
    p.add_argument("--json", default=None, help="write the full report here")
    p.add_argument("--kv-snapshot", default=None, metavar="FILE",
                   help="prefill the prompt once: the first run writes the exact cache's prompt KV to FILE, later "
                   "configurations and runs restore it (checked against the model and tokens) and compute only the "
                   "prompt's last chunk and the decode steps")
    add_needle_flags(p)
    add_flags(p, EngineConfig, ("model_path", "dtype", "decode_activations", "num_threads"),
              "engine")
    p.set_defaults(func=_run_eval)


def _run_eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from flashmemory.engine.engine import FlashMemoryEngine
    from flashmemory.tools.eval import DEFAULT_CONFIGS, default_text_path, parse_config, run_eval, write_json

    given = args.text_option or args.text
    path = Path(given) if given else default_text_path()
    if path is None:
        raise FlashMemoryError("no text given and ../shared/data/alice29.txt not found: pass a long text file")
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise FlashMemoryError(f"cannot read {path}: {e.strerror}") from e
    configs = dict(parse_config(c) for c in args.config) if args.config else DEFAULT_CONFIGS
    engine = FlashMemoryEngine(**engine_kwargs(args), kv_cache="contiguous")
    if args.needles:
        try:
            return run_needles(args, engine, text, path, dict(configs) if args.config else None)
        finally:
            engine.close()
    report = run_eval(engine, text, args.window_tokens, args.decode_tokens, configs, args.passkey_depths,
                      args.passkey_tokens, args.passkey_window, log=lambda m: print(m, file=sys.stderr),
                      kv_snapshot=Path(args.kv_snapshot) if args.kv_snapshot else None)
    report["text"] = str(path)
    print(report["table"])
    if args.json:
        write_json(Path(args.json), report)
    engine.close()
    return 0


def _add_bench_spec(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench-spec",
        help="speculative decoding (a draft model, prompt lookup) against the target alone",
        description="Decode held-out prompts greedily with the target alone and with each drafter, "
        "interleaved; print median decode speed, speed-up, acceptance and differing tokens.")
    p.add_argument("--model", default=None,
                   help="the target model (GGUF or HF folder; default: SmolLM2)")
    p.add_argument("--draft-model", nargs="+", default=[], metavar="DRAFT",
                   help="smaller draft models, each its own engine (another tokenizer is "
                   "bridged); the first is named 'draft', the others by their file")
    p.add_argument("--ngram", action="store_true", help="also run prompt lookup")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens (4)")
    p.add_argument("--runs", type=int, default=3, help="interleaved runs (3)")
    p.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per prompt (64)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads of every engine (2)")
    p.add_argument("--max-seq-len", type=int, default=4096, help="context of every engine (4096)")
    p.add_argument("--text", default=None, help="long text for the summary prompt")
    p.add_argument("--summary-tokens", type=int, default=2048,
                   help="tokens of the text the summary prompt quotes (2048)")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--profile", action="store_true",
                   help="also time one step's parts: the target's decode and verification "
                   "forwards, the draft's decode")
    p.set_defaults(func=lambda args: _bench_spec(args))


def _bench_spec(args: argparse.Namespace) -> int:
    from flashmemory.tools.bench.speculative import main as bench_spec

    return bench_spec(args)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (same as python -m flashmemory.serve)",
        description="Serve /v1/completions, /v1/chat/completions (streaming), /v1/models, /tokenize, /detokenize, "
        "/health and /metrics. Every flag can also be set by a FLASHMEMORY_* environment variable "
        "(FLASHMEMORY_PORT, FLASHMEMORY_API_KEY, FLASHMEMORY_KV_PRECISION, ...); docs/configuration.md lists "
        "them.",
    )
    add_serve_args(p)
    p.set_defaults(func=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    from flashmemory.serve.launcher import run_server

    return run_server(args)


def _add_trace(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trace", help="record block-selection traces (for the heat predictor) over a text",
                       description="Prefill windows of a text, decode the following tokens teacher-forced, and save "
                       "every query-aware block choice (per step, layer, KV head) to an .npz trace.")
    p.add_argument("text", help="a UTF-8 text file (e.g. ../shared/data/lcet10.txt)")
    p.add_argument("--out", required=True, help="trace file to write (.npz)")
    p.add_argument("--context-tokens", type=int, default=8000)
    p.add_argument("--decode-steps", type=int, default=96)
    p.add_argument("--windows", type=int, default=1, help="windows taken at evenly spaced offsets of the text")
    add_engine_flags(p)
    add_kv_flags(p)
    p.set_defaults(func=_run_trace)


def _run_trace(args: argparse.Namespace) -> int:
    from flashmemory.engine.engine import FlashMemoryEngine
    from flashmemory.tools.access_traces import TRACE_KNOBS, read_text, record_trace

    text = read_text(args.text)
    engine = FlashMemoryEngine(**{**TRACE_KNOBS, **engine_kwargs(args), "record_traces": True})
    trace = record_trace(engine, text, args.context_tokens, args.decode_steps, args.windows)
    trace.save(args.out)
    engine.close()
    print(f"wrote {args.out}: {len(trace)} choices", file=sys.stderr)
    return 0


def _add_train_predictor(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-predictor", help="train the heat predictor from traces; compare it with LRU",
                       description="Train the prefetch heat predictor on traces recorded by `flashmemory trace` and "
                       "report its precision/recall against a recency/LRU ranking on held-out traces.")
    p.add_argument("traces", nargs="+", help="training traces (.npz)")
    p.add_argument("--held-out", nargs="+", required=True, help="traces of other texts, for evaluation only")
    p.add_argument("--out", required=True, help="weights file to write (.npz); use it with heat_predictor_path")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--hidden", type=int, default=16, help="units of each of the two hidden layers (default 16)")
    p.set_defaults(func=_run_train_predictor)


def _run_train_predictor(args: argparse.Namespace) -> int:
    import json

    from flashmemory.tools.access_traces import train_from_traces

    figures = train_from_traces(args.traces, args.held_out, args.out, epochs=args.epochs, hidden=args.hidden)
    print(json.dumps(figures, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashmemory", description="FlashMemory long-context LLM inference")
    parser.add_argument("--log-level", default=os.environ.get("FLASHMEMORY_LOG_LEVEL", "WARNING"),
                        help="DEBUG, INFO, WARNING (default) or ERROR")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_eval(sub)
    add_bench_command(sub)
    _add_bench_spec(sub)
    add_diagnose_command(sub)
    add_doctor_command(sub)
    _add_serve(sub)
    _add_trace(sub)
    _add_train_predictor(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except FlashMemoryError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
