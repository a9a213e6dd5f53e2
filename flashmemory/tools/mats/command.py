"""`flashmemory-test mats`: its flags, their checks, and running one suite to a report and an exit status."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

from flashmemory.tools.mats.options import LEVELS, RSS_REQUESTS, RSS_TOLERANCE, MatsOptions
from flashmemory.tools.mats.progress import default_enabled
from flashmemory.tools.mats.report import SuiteReport

MAX_DURATION_S = 7 * 24 * 3600.0
EXIT_PASSED, EXIT_ERRORS, EXIT_USAGE = 0, 1, 2
MATS3_ONLY = ("server_args", "concurrency", "window", "idle", "rss_requests")

DESCRIPTION = """\
KV-memory stress and integrity suites (MATS). Each runs for --duration seconds, prints a text report ending in
a summary line ("N ops, 0 errors"), and exits 0 when it found nothing wrong, 1 when it found an error.

  --level 1  MATS-1 temporal stress: random multi-sequence workloads through every level of a real tiered KV
             cache (synthetic K/V), every read and attention output checked against a shadow copy
  --level 2  MATS-2 level coherence: prefetch threads, device staging, rewrites, evictions and aborts racing
             over a cold-zone file with injected faults; 0 stale reads, 0 leaks, every fault detected
  --level 3  MATS-3 endurance: a real server under a mixed load; latency, RSS and disk drift, 5xx count, and
             GPU temperature / clocks / ECC through NVML where a GPU exists
"""


def _seconds(flag: str, low: float = 0.0) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes a number of seconds, got {text!r}") from None
        if not math.isfinite(value) or value <= low or value > MAX_DURATION_S:
            raise argparse.ArgumentTypeError(f"{flag} must be > {low:g} and at most {MAX_DURATION_S:.0f} seconds "
                                             f"(7 days), got {text}")
        return value
    return parse


def _count(flag: str, low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes a whole number, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{flag} must be at least {low}, got {value}")
        return value
    return parse


def add_mats_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("mats", help="KV-memory stress and integrity suites (MATS-1, -2, -3)",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--level", type=int, choices=sorted(LEVELS), default=1, help="which suite (default: 1)")
    p.add_argument("--duration", type=_seconds("--duration"), default=60.0, metavar="S",
                   help="seconds the suite keeps the load on (default: 60)")
    p.add_argument("--seed", type=_count("--seed", 0), default=0, help="seed of every random choice (default: 0)")
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")
    p.add_argument("--report", metavar="PATH", help="also write the text report to PATH")
    p.add_argument("--workdir", metavar="DIR", help="folder for cold-zone files and the server's log (a private "
                   "temporary folder inside it, removed after; default: the system's temporary folder)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (it is drawn on a terminal only)")
    m3 = p.add_argument_group("MATS-3 (--level 3) only")
    p.add_argument("--model", metavar="PATH", help="MATS-2: the engine case's model; MATS-3: the served model "
                   "(default: the embedded SmolLM2-135M-Instruct)")
    m3.add_argument("--server-arg", dest="server_args", action="append", metavar="FLAG",
                    help="an extra flag for `python -m flashmemory.serve`, repeatable; quote a flag with its value: "
                         "--server-arg='--active-window 512' (after the suite's defaults, so it wins)")
    m3.add_argument("--concurrency", type=_count("--concurrency", 1), help="clients at once (default: 6)")
    m3.add_argument("--window", type=_seconds("--window"), metavar="S",
                    help="latency window in seconds (default: a tenth of the duration)")
    m3.add_argument("--idle", type=_seconds("--idle", low=-1e-9), metavar="S",
                    help="seconds the server idles before its idle RSS is read (default: 15)")
    m3.add_argument("--rss-requests", type=_count("--rss-requests", 1), metavar="N",
                    help=f"requests before the RSS check is judged (default: {RSS_REQUESTS}; within "
                         f"{100 * RSS_TOLERANCE:.0f}%% of the first request's RSS)")
    p.set_defaults(run=run_mats, parser=p)
    return p


def options_from_args(args: argparse.Namespace) -> MatsOptions:
    """The run's options; a flag that does not fit the level or the file system is a usage error (exit 2)."""
    parser: argparse.ArgumentParser = args.parser
    if args.level != 3:
        given = [name for name in MATS3_ONLY if getattr(args, name) is not None]
        if given:
            flags = ", ".join("--" + name.replace("_", "-").replace("server-args", "server-arg") for name in given)
            parser.error(f"{flags} apply to --level 3 only (MATS-3 runs a server); this run is --level {args.level}")
    if args.level == 1 and args.model is not None:
        parser.error("--model applies to --level 2 (its engine case) and 3 only; MATS-1 runs no model")
    for flag, path in (("--json", args.json), ("--report", args.report)):
        if path is not None and not Path(path).resolve().parent.is_dir():
            parser.error(f"{flag} {path}: the folder {Path(path).resolve().parent} does not exist")
    if args.workdir is not None and not (Path(args.workdir).is_dir() and os.access(args.workdir, os.W_OK)):
        parser.error(f"--workdir {args.workdir}: not a writable folder")
    if args.model is not None and not Path(args.model).exists():
        parser.error(f"--model {args.model}: no such file or folder")
    defaults = MatsOptions()
    server_args = [part for flag in (args.server_args or []) for part in flag.split()]
    return MatsOptions(
        level=args.level, duration_s=args.duration, seed=args.seed, workdir=args.workdir,
        progress=not args.no_progress and default_enabled(), model=args.model, server_args=server_args,
        concurrency=args.concurrency or defaults.concurrency, window_s=args.window,
        idle_s=defaults.idle_s if args.idle is None else args.idle,
        rss_requests=args.rss_requests or defaults.rss_requests)


def run_suite(options: MatsOptions) -> SuiteReport:
    if options.level == 1:
        from flashmemory.tools.mats.temporal import run_temporal
        return run_temporal(options)
    if options.level == 2:
        from flashmemory.tools.mats.coherence import run_coherence
        return run_coherence(options)
    from flashmemory.tools.mats.endurance import run_endurance
    return run_endurance(options)


def run_mats(args: argparse.Namespace) -> int:
    options = options_from_args(args)
    print(f"{LEVELS[options.level]}: running for {options.duration_s:g} s (seed {options.seed})", file=sys.stderr,
          flush=True)
    report = run_suite(options)
    text = report.render_text()
    print(text, end="", flush=True)
    if args.report:
        Path(args.report).write_text(text)
    if args.json:
        report.write_json(args.json)
    return EXIT_PASSED if report.passed else EXIT_ERRORS
