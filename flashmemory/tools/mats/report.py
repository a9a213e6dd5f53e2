"""What a MATS suite found: operations and errors per level, pass/fail checks, tables; as text and as JSON."""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MAX_ERROR_SAMPLES = 20  # error messages kept verbatim (the count covers all of them)


@dataclass
class LevelTally:
    """Reads of one KV level checked against the shadow, and what they found."""

    reads: int = 0  # (block, layer) reads verified
    bytes_verified: int = 0  # encoded bytes of those reads
    errors: int = 0  # reads that differed from what was written (beyond the codec's bound, or re-encoded bytes)
    worst_error_ratio: float = 0.0  # largest |read - written| / bound over the level's elements (<= 1 passes)

    def add_read(self, nbytes: int, error_ratio: float = 0.0) -> None:
        self.reads += 1
        self.bytes_verified += nbytes
        self.worst_error_ratio = max(self.worst_error_ratio, error_ratio)


class ErrorLog:
    """Counts errors by kind and keeps the first few messages."""

    def __init__(self) -> None:
        self.by_kind: Counter[str] = Counter()
        self.samples: list[str] = []

    @property
    def count(self) -> int:
        return sum(self.by_kind.values())

    def add(self, kind: str, message: str) -> None:
        self.by_kind[kind] += 1
        if len(self.samples) < MAX_ERROR_SAMPLES:
            self.samples.append(f"{kind}: {message}")


@dataclass
class Check:
    """One pass/fail figure of a suite (passed None: not evaluated, `note` says why)."""

    name: str
    value: Any
    limit: str  # the requirement, e.g. "== 0" or "<= 1.10 x first"
    passed: bool | None
    note: str = ""


@dataclass
class Table:
    """A small table for the text report (and the JSON)."""

    title: str
    headers: list[str]
    rows: list[list[Any]]


@dataclass
class SuiteReport:
    """Everything one run of one suite reports."""

    suite: str  # "MATS-1"
    title: str  # "temporal stress"
    seed: int
    duration_s: float  # asked for
    elapsed_s: float = 0.0
    ops: int = 0
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    error_samples: list[str] = field(default_factory=list)
    levels: dict[str, LevelTally] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)  # operations and events by kind
    checks: list[Check] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # configuration, machine, what was skipped and why
    warnings: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.errors == 0 and all(c.passed is not False for c in self.checks)

    def take_errors(self, log: ErrorLog) -> None:
        self.errors = log.count
        self.error_kinds = dict(log.by_kind)
        self.error_samples = list(log.samples)

    def summary_line(self) -> str:
        failed = [c.name for c in self.checks if c.passed is False]
        verdict = "passed" if self.passed else "FAILED"
        tag = "INFO" if self.passed else "ERROR"
        extra = f"; failed checks: {', '.join(failed)}" if failed else ""
        return f"[{tag}] {self.suite}: {self.title} {verdict} ({self.ops} ops, {self.errors} errors{extra})"

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["passed"] = self.passed
        out["summary"] = self.summary_line()
        return _finite(out)

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    def render_text(self) -> str:
        lines = [f"{self.suite} — {self.title}", "=" * (len(self.suite) + len(self.title) + 3),
                 f"seed {self.seed}, asked {self.duration_s:g} s, ran {self.elapsed_s:.1f} s, {self.ops} ops, "
                 f"{self.errors} errors"]
        lines += [f"  {note}" for note in self.notes]
        if self.levels:
            rows = [[name, t.reads, _bytes(t.bytes_verified), t.errors, f"{t.worst_error_ratio:.3f}"]
                    for name, t in self.levels.items()]
            lines += ["", *_table(Table("Reads checked against the shadow, per level",
                                        ["level", "reads", "bytes", "errors", "worst err/bound"], rows))]
        if self.counters:
            width = max(len(k) for k in self.counters)
            lines += ["", "Counters"] + [f"  {k:<{width}}  {_fmt(v)}" for k, v in self.counters.items()]
        for table in self.tables:
            lines += ["", *_table(table)]
        if self.checks:
            rows = [[c.name, _fmt(c.value), c.limit, _verdict(c.passed), c.note] for c in self.checks]
            lines += ["", *_table(Table("Checks", ["check", "value", "requirement", "result", "note"], rows))]
        if self.error_kinds:
            lines += ["", "Errors by kind"] + [f"  {k}: {n}" for k, n in self.error_kinds.items()]
            lines += ["First errors"] + [f"  {s}" for s in self.error_samples]
        lines += [""] + [f"[WARN] {self.suite}: {w}" for w in self.warnings] + [self.summary_line()]
        return "\n".join(lines) + "\n"


def _verdict(passed: bool | None) -> str:
    return "n/a" if passed is None else ("pass" if passed else "FAIL")


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.4g}" if abs(value) < 1e6 else f"{value:.4e}"
    return str(value)


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _table(table: Table) -> list[str]:
    cells = [table.headers] + [[_fmt(c) for c in row] for row in table.rows]
    widths = [max(len(str(row[i])) for row in cells) for i in range(len(table.headers))]
    out = [table.title]
    for j, row in enumerate(cells):
        out.append("  " + "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
        if j == 0:
            out.append("  " + "  ".join("-" * w for w in widths))
    return out


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: they become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
