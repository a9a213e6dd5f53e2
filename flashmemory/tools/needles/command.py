"""`flashmemory eval --needles`: its flags and what running it does (heavy imports deferred)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from flashmemory.tools.needles.suite import LAYOUTS, SuiteSpec
from flashmemory.tools.needles.tasks import TASKS

DEFAULTS = SuiteSpec()


def add_needle_flags(p: argparse.ArgumentParser) -> None:
    """The needle suite's flags on `flashmemory eval`."""
    g = p.add_argument_group("needle suite (--needles)")
    g.add_argument(
        "--needles",
        action="store_true",
        help="run the RULER-style retrieval suite instead of the "
        "perplexity comparison: each config against exact attention on the same trials",
    )
    g.add_argument(
        "--needle-tasks",
        nargs="+",
        default=list(DEFAULTS.tasks),
        choices=TASKS,
        metavar="TASK",
        help=f"tasks ({', '.join(TASKS)}; default: all)",
    )
    g.add_argument(
        "--needle-lengths",
        nargs="+",
        type=int,
        default=list(DEFAULTS.lengths_tokens),
        metavar="TOKENS",
        help="prompt lengths (default: 1024 1536)",
    )
    g.add_argument(
        "--needle-depths",
        nargs="+",
        type=float,
        default=list(DEFAULTS.depths),
        metavar="FRACTION",
        help="target needle depths, 0..1 (default: 0.1 to 0.9 by 0.1)",
    )
    g.add_argument(
        "--needle-trials-per-cell",
        type=int,
        default=DEFAULTS.trials_per_cell,
        help="seeded trials per task, length and depth (default 1: 108 trials in all)",
    )
    g.add_argument(
        "--needle-seed", type=int, default=DEFAULTS.seed, help="seed of placements and values"
    )
    g.add_argument(
        "--needle-layout",
        choices=LAYOUTS,
        default=DEFAULTS.layout,
        help="separate: each trial its own haystack (RULER's); shared: every trial of a length "
        "in one "
        "haystack, prefilled once per configuration and reused by each question through the prefix "
        "cache (for 8K-32K on a CPU; docs/needles.md)",
    )
    g.add_argument(
        "--needle-snapshot-dir",
        default=None,
        metavar="DIR",
        help="with --needle-layout shared: the exact cache prefills each haystack once into a KV "
        "snapshot here (kept for later runs) and every configuration restores it",
    )
    g.add_argument(
        "--heatmaps-dir", default=None, help="write one length x depth PNG per config here"
    )
    g.add_argument(
        "--needle-condense-with",
        default=None,
        metavar="READER",
        help="also run the seeds' pipeline: this smaller model (GGUF or HF folder; another "
        "tokenizer is bridged) condenses each haystack, the model answers from what it kept "
        "(flashmemory/pipeline; without --config, the only configuration besides exact)",
    )


def run_needles(
    args: argparse.Namespace,
    engine,
    text: str,
    text_path: Path,
    configs: dict[str, dict[str, Any]] | None,
) -> int:
    """Build the trials, run them through exact attention and each config, print and write the
    report."""
    from flashmemory.tools.needles import report
    from flashmemory.tools.needles.prefill_once import HaystackPrefill
    from flashmemory.tools.needles.runner import DEFAULT_CONFIGS, run_suite
    from flashmemory.tools.needles.suite import build_trials
    from flashmemory.tools.needles.tasks import TrialBuilder

    if args.needle_snapshot_dir and args.needle_layout != "shared":
        print(
            "error: --needle-snapshot-dir needs --needle-layout shared (a snapshot holds one "
            "haystack that "
            "many trials share)",
            file=sys.stderr,
        )
        return 2
    spec = SuiteSpec(
        tuple(args.needle_tasks),
        tuple(args.needle_lengths),
        tuple(args.needle_depths),
        args.needle_trials_per_cell,
        args.needle_seed,
        args.needle_layout,
    )
    trials = list(build_trials(TrialBuilder(engine.tokenizer, text), spec))
    condense_with = getattr(args, "needle_condense_with", None)
    if not configs:
        configs = {} if condense_with else DEFAULT_CONFIGS
    too_long = [t for t in trials if len(t.token_ids) + t.max_new_tokens > engine.max_seq_len]
    if too_long:  # refused before any trial runs, not at the first one that reaches the limit
        worst = max(too_long, key=lambda t: len(t.token_ids) + t.max_new_tokens)
        room = (
            engine.max_seq_len - (len(worst.token_ids) - worst.length_tokens) - worst.max_new_tokens
        )
        print(
            f"error: --needle-lengths {worst.length_tokens} leaves no room for a {worst.task} "
            f"trial's answer: its prompt is {len(worst.token_ids)} tokens and its answer up to "
            f"{worst.max_new_tokens}, over the "
            f"model's {engine.max_seq_len}; use lengths of at most {room}",
            file=sys.stderr,
        )
        return 2

    def progress(name: str, done: int, total: int) -> None:
        if done == total or done % 10 == 0:
            print(f"[{name}] {done}/{total} trials", file=sys.stderr, flush=True)

    prefill = HaystackPrefill(
        Path(args.needle_snapshot_dir) if args.needle_snapshot_dir else None,
        log=lambda m: print(m, file=sys.stderr, flush=True),
    )
    meta = {
        "text": str(text_path),
        "tasks": list(spec.tasks),
        "lengths_tokens": list(spec.lengths_tokens),
        "depths": list(spec.depths),
        "trials_per_cell": spec.trials_per_cell,
        "seed": spec.seed,
        "layout": spec.layout,
        "num_trials": len(trials),
        "snapshot_seconds": prefill.snapshot_seconds,
    }

    def save(runs_so_far) -> None:
        if args.json:
            report.write_json(
                Path(args.json),
                report.to_json(runs_so_far, {**meta, "table": report.format_table(runs_so_far)}),
            )

    runs = run_suite(engine, trials, configs, progress, on_config=save, prefill=prefill)
    if condense_with:
        from flashmemory.tools.needles.condensed import run_condensed

        runs.append(run_condensed(engine, condense_with, trials, progress))
        save(runs)
        print(_condense_line(runs[-1]), file=sys.stderr)
    print(report.format_table(runs))
    print()
    print(report.format_regressions(runs))
    if args.heatmaps_dir:
        for path in report.write_heatmaps(runs, Path(args.heatmaps_dir)):
            print(f"wrote {path}", file=sys.stderr)
    return 0


def _condense_line(run) -> str:
    s = run.kv_stats
    return (f"{run.name}: needles kept {s.get('condense_needles_kept', 0):.0%}, reader "
            f"{s.get('condense_reader_s_median', 0):.1f} s and answer "
            f"{s.get('condense_answer_s_median', 0):.1f} s per trial (medians), answer prompts of "
            f"{s.get('condense_prompt_tokens_median', 0):.0f} tokens")
