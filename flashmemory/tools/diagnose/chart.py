"""The diagnose chart (matplotlib, PNG): where each byte lives, and where each millisecond of a step goes."""

from __future__ import annotations

from pathlib import Path

from flashmemory.errors import FlashMemoryError
from flashmemory.tools.diagnose.report import MIB, DiagnoseReport
from flashmemory.tools.diagnose.timers import PHASES

COLORS = {"weights": "#4c72b0", "attention": "#dd8452", "selection": "#55a868", "transfers": "#c44e52",
          "overhead": "#8c8c8c"}


def write_chart(report: DiagnoseReport, path: str | Path) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise FlashMemoryError("--chart needs matplotlib: pip install matplotlib") from e
    kinds = list(report.time)
    fig, axes = plt.subplots(1, 1 + len(kinds), figsize=(5 + 3.5 * len(kinds), 4.8),
                             gridspec_kw={"width_ratios": [2] + [1] * len(kinds)})
    left = axes[0]
    places = ("device", "host", "disk")
    stages = [s for s in report.stages if s.bytes]
    bottoms = {p: 0.0 for p in places}
    cmap = plt.get_cmap("tab10")
    for i, stage in enumerate(stages):
        heights = [stage.bytes / MIB if stage.where == p else 0 for p in places]
        left.bar(places, heights, bottom=[bottoms[p] for p in places], color=cmap(i % 10), label=stage.name)
        for p, h in zip(places, heights):
            bottoms[p] += h
    left.set_ylabel("MiB held at the run's end")
    left.set_title("Where each byte lives")
    left.legend(fontsize=7, loc="upper right")
    for ax, kind in zip(axes[1:], kinds):  # one axis per kind of step: a prefill chunk dwarfs a decode step
        t, bottom = report.time[kind], 0.0
        for phase in PHASES:
            ax.bar([kind], [t.phases_ms[phase]], bottom=[bottom], color=COLORS[phase], label=phase)
            if t.phases_ms[phase] >= 0.04 * t.ms_per_step:
                ax.text(0, bottom + t.phases_ms[phase] / 2, f"{phase} {t.phases_ms[phase]:.1f}", ha="center",
                        va="center", fontsize=7)
            bottom += t.phases_ms[phase]
        ax.set_title(f"{kind}: {t.ms_per_step:.1f} ms per step ({t.steps} steps)", fontsize=9)
        ax.set_ylabel("ms per step")
    axes[-1].legend(fontsize=7, loc="upper right")
    fig.suptitle(f"{report.model}: {report.workload['prompt_tokens']} prompt tokens, "
                 f"{report.workload['decode_tokens']} decoded", fontsize=10)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
