"""PNG charts of a benchmark (matplotlib, an optional extra): device KV and decode speed against the context
length, and fidelity against device KV bytes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from flashmemory.tools.bench.engines import FLASHMEMORY, LLAMA_CPP
from flashmemory.tools.bench.runner import BenchReport

MIB = 2**20
CHART_FILES = ("kv_device_memory.png", "decode_speed.png", "fidelity_vs_device_bytes.png")
_STYLE = {FLASHMEMORY: "-", LLAMA_CPP: ":"}  # transformers: dashed


def charts_unavailable_reason() -> str | None:
    if importlib.util.find_spec("matplotlib") is None:
        return "charts skipped: pip install matplotlib (or the extra: pip install 'flashmemory[bench]')"
    return None


def write_charts(report: BenchReport, folder: Path) -> list[Path]:
    """Write the three charts into folder; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    folder.mkdir(parents=True, exist_ok=True)
    families = {e.name: e.family for e in report.engines}
    ok = [r for r in report.rows if r.status == "ok"]
    names = [e.name for e in report.engines if any(r.engine == e.name for r in ok)]
    budget = report.settings["budget_bytes"]
    palette = plt.get_cmap("tab20").colors
    colors = {e.name: palette[i % len(palette)] for i, e in enumerate(report.engines)}  # one color per engine
    paths = []

    def per_length(ax, value, ylabel: str, title: str) -> None:
        for name in names:
            pts = sorted((r.prompt_tokens, value(r)) for r in ok if r.engine == name)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], _STYLE.get(families[name], "--"), marker="o",
                    color=colors[name], label=name, linewidth=2.2 if families[name] == FLASHMEMORY else 1.2)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r.prompt_tokens for r in ok}), labels=[str(n) for n in sorted({r.prompt_tokens
                                                                                              for r in ok})])
        ax.minorticks_off()
        ax.set_xlabel("context (prompt tokens)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)

    fig, ax = plt.subplots(figsize=(9, 6))
    per_length(ax, lambda r: r.device_kv_bytes / MIB, "KV held in device memory (MiB)",
               "Device KV memory vs context length")
    ax.axhline(budget / MIB, color="black", linewidth=0.8, linestyle="-.")
    ax.annotate(f"fixed budget {budget / MIB:.1f} MiB", (ax.get_xlim()[0], budget / MIB), fontsize=8,
                xytext=(4, 4), textcoords="offset points")
    ax.set_yscale("log")
    ax.legend(fontsize=7, ncol=2)
    paths.append(_save(fig, folder / CHART_FILES[0]))

    fig, ax = plt.subplots(figsize=(9, 6))
    per_length(ax, lambda r: r.decode_tok_s, "decode tokens/s", "Decode speed vs context length")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, ncol=2)
    paths.append(_save(fig, folder / CHART_FILES[1]))

    fig, (ax_top1, ax_kl) = plt.subplots(1, 2, figsize=(12, 5.5))
    measured = [f for f in report.fidelity if not f["error"]]
    if measured:
        context = measured[0]["context_tokens"]
        device = {r.engine: r.device_kv_bytes / MIB for r in ok if r.prompt_tokens == context}
        labels: dict[tuple, list[str]] = {}  # engines on the same point share one label
        for f in measured:
            if f["engine"] not in device:
                continue
            x = device[f["engine"]]
            marker = "o" if families.get(f["engine"]) == FLASHMEMORY else "s"
            color = colors.get(f["engine"])
            top1, kl = f["top1_agreement"] * 100, max(f["mean_kl"], 1e-6)
            ax_top1.scatter(x, top1, marker=marker, color=color)
            ax_kl.scatter(x, kl, marker=marker, color=color)
            near_x = float(f"{x:.2g}")  # points that draw on top of each other share a label
            labels.setdefault((ax_top1, near_x, round(top1, 1)), []).append(f["engine"])
            labels.setdefault((ax_kl, near_x, float(f"{kl:.2g}")), []).append(f["engine"])
        for (ax, x, y), engines in labels.items():
            ax.annotate(" / ".join(engines), (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        for ax in (ax_top1, ax_kl):
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set_xlabel(f"KV held in device memory at {context} tokens (MiB)")
            ax.grid(True, which="both", alpha=0.3)
        ax_top1.set_ylabel("top-1 agreement with the reference (%)")
        ax_kl.set_ylabel("mean KL(reference || engine) (floor 1e-6)")
        ax_kl.set_yscale("log")
        fig.suptitle("Fidelity vs device KV bytes (up-left is better)")
    paths.append(_save(fig, folder / CHART_FILES[2]))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
