"""`flashmemory bench --decode-only`: decode speed side by side, fairly. One persistent worker process per engine
(decode_worker.py) holds the same GGUF, prefills the same token ids, then runs teacher-forced decode steps in
interleaved rounds (every engine's round r covers the same positions), so machine noise falls on all alike.
Each engine runs with the threading it measures best at: llama.cpp with OpenMP's default wait policy, ours as
configured (recorded); peak RSS is read in each worker, which holds only its engine (no torch in llama.cpp's)."""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from flashmemory.tools.bench.decode_worker import REPLY_PREFIX

MIB = 2**20


@dataclass(frozen=True)
class DecodeEngine:
    """One engine of the comparison: its family and settings, and its OMP_WAIT_POLICY (None = OpenMP's default)."""

    name: str
    family: str  # "flashmemory" | "llama.cpp"
    settings: dict[str, Any] = field(default_factory=dict)
    omp_wait_policy: str | None = None


def default_engines(fm_wait_policy: str | None) -> tuple[DecodeEngine, ...]:
    """Ours as the GGUF is stored, ours in float32, and llama.cpp (f16 KV) when llama-cpp-python is installed."""
    engines = (DecodeEngine("fm", "flashmemory", {}, fm_wait_policy),
               DecodeEngine("fm-float32", "flashmemory", {"weights_dtype": "float32"}, fm_wait_policy))
    if importlib.util.find_spec("llama_cpp") is not None:
        engines += (DecodeEngine("llamacpp", "llama.cpp", {}, None),)
    return engines


@dataclass
class DecodeRow:
    """One engine at one context length: medians over every measured step."""

    context_tokens: int
    engine: str
    ms_per_token: float
    decode_tok_s: float
    prefill_tok_s: float
    peak_rss_mib: float
    vs_llamacpp: float | None  # our tok/s over llama.cpp's (None for llama.cpp itself)
    step_ms: list[float]
    omp_wait_policy: str


def _env(engine: DecodeEngine, threads: int) -> dict[str, str]:
    package_root = str(Path(__file__).resolve().parents[3])
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
                "PYTHONPATH": package_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")})
    if engine.omp_wait_policy:
        env["OMP_WAIT_POLICY"] = engine.omp_wait_policy
    return env


class _Worker:
    """A running decode_worker process and its command pipe."""

    def __init__(self, engine: DecodeEngine, spec_path: Path, threads: int) -> None:
        self.engine = engine
        self.proc = subprocess.Popen([sys.executable, "-m", "flashmemory.tools.bench.decode_worker", str(spec_path)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=_env(engine, threads))

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(REPLY_PREFIX):
                return json.loads(line[len(REPLY_PREFIX):])
        raise RuntimeError(f"{self.engine.name}: the worker exited (status {self.proc.wait()}) without replying")

    def send(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self.read()


def run_decode_compare(gguf_path: Path, ids_path: Path, lengths: list[int], rounds: int, steps: int, threads: int,
                       engines: tuple[DecodeEngine, ...], work_dir: Path,
                       log: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    rows: list[DecodeRow] = []
    load_before = os.getloadavg()
    for length in lengths:
        workers: list[_Worker] = []
        prefill: dict[str, float] = {}
        for engine in engines:  # one at a time: loading and prefilling do not overlap
            spec = {"family": engine.family, "gguf_path": str(gguf_path), "ids_path": str(ids_path),
                    "context_tokens": length, "max_steps": rounds * steps, "threads": threads,
                    "settings": engine.settings}
            spec_path = work_dir / f"decode-{engine.name}-{length}.json"
            spec_path.write_text(json.dumps(spec))
            worker = _Worker(engine, spec_path, threads)
            prefill[engine.name] = worker.read()["prefill_s"]
            log(f"{length} tokens: {engine.name} prefilled in {prefill[engine.name]:.1f} s")
            workers.append(worker)
        times: dict[str, list[float]] = {e.name: [] for e in engines}
        for r in range(rounds):
            order = workers[r % len(workers):] + workers[: r % len(workers)]  # who goes first rotates
            for worker in order:
                times[worker.engine.name] += worker.send({"cmd": "steps", "num": steps})["ms"]
            log(f"{length} tokens, round {r + 1}/{rounds}: " + ", ".join(
                f"{n} {statistics.median(t):.1f} ms" for n, t in times.items()))
        rss = {w.engine.name: w.send({"cmd": "quit"})["peak_rss_bytes"] for w in workers}
        for w in workers:
            w.proc.wait(timeout=60)
        reference = next((statistics.median(times[e.name]) for e in engines if e.family == "llama.cpp"), None)
        for engine in engines:
            ms = statistics.median(times[engine.name])
            rows.append(DecodeRow(
                length, engine.name, ms, 1e3 / ms, length / prefill[engine.name], rss[engine.name] / MIB,
                None if engine.family == "llama.cpp" or reference is None else reference / ms, times[engine.name],
                engine.omp_wait_policy or "default"))
    return {"rows": [asdict(r) for r in rows], "threads": threads, "rounds": rounds, "steps_per_round": steps,
            "load_average_before": load_before, "load_average_after": os.getloadavg(), "gguf": str(gguf_path),
            "finished": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}


def to_markdown(report: dict[str, Any]) -> str:
    lines = ["| context | engine | decode ms/token | decode tok/s | vs llama.cpp | prefill tok/s | peak RSS MiB | "
             "OMP_WAIT_POLICY |", "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        ratio = "—" if r["vs_llamacpp"] is None else f"{r['vs_llamacpp']:.2f}x"
        lines.append(f"| {r['context_tokens']} | {r['engine']} | {r['ms_per_token']:.1f} | {r['decode_tok_s']:.1f} | "
                     f"{ratio} | {r['prefill_tok_s']:.0f} | {r['peak_rss_mib']:.0f} | {r['omp_wait_policy']} |")
    before = ", ".join(f"{x:.1f}" for x in report["load_average_before"])
    after = ", ".join(f"{x:.1f}" for x in report["load_average_after"])
    lines.append("")
    lines.append(f"{report['threads']} threads per engine; {report['rounds']} interleaved rounds of "
                 f"{report['steps_per_round']} teacher-forced steps (medians of every step); load average "
                 f"{before} before, {after} after; {Path(report['gguf']).name}.")
    return "\n".join(lines)
