"""The needle suite's report: pass rates per configuration, "exact right, tiered wrong" cases,
JSON, heat maps."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from flashmemory.errors import FlashMemoryError
from flashmemory.tools.needles.runner import ConfigRun, TrialResult


def regressions(baseline: ConfigRun, run: ConfigRun) -> list[tuple[TrialResult, TrialResult]]:
    """(exact, config) result pairs of the trials exact attention answers and the configuration
    does not."""
    return [
        (b, r)
        for b, r in zip(baseline.results, run.results, strict=True)
        if b.passed and not r.passed
    ]


def cell_rates(run: ConfigRun) -> dict[tuple[int, float], float]:
    """Pass rate per (length, depth) cell, over every task."""
    cells: dict[tuple[int, float], list[bool]] = {}
    for r in run.results:
        cells.setdefault((r.length_tokens, r.depth), []).append(r.passed)
    return {cell: sum(v) / len(v) for cell, v in cells.items()}


def task_rates(run: ConfigRun) -> dict[str, float]:
    tasks: dict[str, list[bool]] = {}
    for r in run.results:
        tasks.setdefault(r.task, []).append(r.passed)
    return {task: sum(v) / len(v) for task, v in tasks.items()}


def format_table(runs: list[ConfigRun]) -> str:
    """Markdown: pass rate overall and per task, regressions against the first run, old KV read
    per step."""
    baseline = runs[0]
    tasks = list(task_rates(baseline))
    head = (
        "| config | pass | "
        + " | ".join(tasks)
        + " | exact right, config wrong | config right, exact wrong "
        "| old KV read / step | selection ms / step | s | of which haystacks s |"
    )
    rule = "|---|---:|" + "---:|" * len(tasks) + "---:|---:|---:|---:|---:|---:|"
    rows = []
    for run in runs:
        rates = task_rates(run)
        lost = len(regressions(baseline, run))
        won = sum(1 for b, r in zip(baseline.results, run.results) if r.passed and not b.passed)
        fraction = run.kv_stats.get("selection_old_read_fraction")
        ms = run.kv_stats.get("selection_ms_per_step")
        rows.append(
            f"| {run.name} | {run.pass_rate:.1%} | "
            + " | ".join(f"{rates[t]:.0%}" for t in tasks)
            + f" | {lost} | {won} | {'-' if fraction is None else f'{fraction:.1%}'} | "
            f"{'-' if ms is None else f'{ms:.2f}'} | {run.seconds:.0f} | "
            f"{run.haystack_seconds:.0f} |"
        )
    return "\n".join([head, rule, *rows])


def format_regressions(runs: list[ConfigRun]) -> str:
    """Every "exact right, config wrong" case: task, length, depth, expected, what the config
    answered."""
    lines = []
    for run in runs[1:]:
        for b, r in regressions(runs[0], run):
            lines.append(
                f"{run.name}: {r.task} length {r.length_tokens} depth {r.depth:g} "
                f"expected {' '.join(r.expected)!r} got {r.answer.strip()!r} "
                f"(exact: {b.answer.strip()!r})" + _sight(r.needle)
            )
    return (
        "\n".join(lines)
        if lines
        else "no trial that exact attention answers is lost by any configuration"
    )


def _sight(needle: dict[str, Any] | None) -> str:
    """Where the needle was while the config decoded (needles/probe.py), for a regression's line."""
    if not needle:
        return ""
    if needle.get("condensed"):
        return (f"; the reader {'kept' if needle['needle_kept'] else 'dropped'} the needle "
                f"({needle['prompt_tokens']} prompt tokens)")
    if not needle["candidates"]:
        return f"; needle in {needle['level']} (read whole)"
    return (
        f"; needle in {needle['level']}, chosen {needle['chosen_share']:.0%} of "
        f"{needle['candidates']} "
        f"(step, layer, head) choices, median rank {needle['median_rank']}"
    )


def to_json(runs: list[ConfigRun], meta: dict[str, Any]) -> dict[str, Any]:
    baseline = runs[0]
    return {
        **meta,
        "baseline": baseline.name,
        "configs": [
            {
                "name": run.name,
                "knobs": run.knobs,
                "pass_rate": run.pass_rate,
                "seconds": run.seconds,
                "haystack_seconds": run.haystack_seconds,
                "haystack_tokens_restored": run.haystack_tokens_restored,
                "kv_stats": run.kv_stats,
                "task_pass_rates": task_rates(run),
                "exact_right_config_wrong": [
                    {
                        "task": r.task,
                        "length_tokens": r.length_tokens,
                        "depth": r.depth,
                        "key": r.key,
                        "expected": r.expected,
                        "got": r.answer,
                        "exact_got": b.answer,
                        "needle": r.needle,
                    }
                    for b, r in regressions(baseline, run)
                ],
                "results": [asdict(r) for r in run.results],
            }
            for run in runs
        ],
    }


def write_json(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))


def write_heatmaps(runs: list[ConfigRun], folder: Path) -> list[Path]:
    """One PNG per configuration: pass rate over every task, length (rows) x depth (columns)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise FlashMemoryError(
            "heat maps need matplotlib: pip install 'flashmemory-runtime[eval]'"
        ) from e
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for run in runs:
        rates = cell_rates(run)
        lengths = sorted({c[0] for c in rates})
        depths = sorted({c[1] for c in rates})
        grid = [[rates.get((n, d), float("nan")) for d in depths] for n in lengths]
        fig, ax = plt.subplots(figsize=(1.0 + 0.8 * len(depths), 1.2 + 0.6 * len(lengths)))
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set_yticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_xlabel("needle depth")
        ax.set_ylabel("prompt tokens")
        ax.set_title(f"{run.name}: pass rate {run.pass_rate:.0%}", fontsize=10)
        for i, row in enumerate(grid):
            for j, value in enumerate(row):
                ax.text(j, i, f"{value:.0%}", ha="center", va="center", fontsize=8)
        fig.colorbar(image, ax=ax, fraction=0.05)
        fig.tight_layout()
        path = folder / f"needles-{run.name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths
