"""Runs one benchmark job in a fresh Python process and reads back its result line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from itertools import count
from pathlib import Path
from typing import Any

from flashmemory.tools.bench.jobs import FidelityJob, SpeedJob, write_job
from flashmemory.tools.bench.worker import RESULT_PREFIX


def worker_env(num_threads: int) -> dict[str, str]:
    """The environment of every worker: the same thread count for every engine's OpenMP pool, passive waiting
    for the torch engines (spinning OpenMP threads lose 10x on a shared machine), and this very copy of the package
    on the path. llama.cpp workers get OpenMP's default wait policy instead (`engine_env`)."""
    package_root = str(Path(__file__).resolve().parents[3])  # the folder holding flashmemory/
    path = os.environ.get("PYTHONPATH", "")
    return {
        **os.environ,
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
        "OMP_NUM_THREADS": str(num_threads),
        "MKL_NUM_THREADS": str(num_threads),
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": package_root + (os.pathsep + path if path else ""),
    }


def engine_env(env: dict[str, str], engine: str) -> dict[str, str]:
    """The environment for one engine's worker: llama.cpp runs with OpenMP's default wait policy (passive waiting
    turns each of ggml's per-node barriers into a sleep: its 2 threads then run slower than 1), unless
    FLASHMEMORY_BENCH_LLAMACPP_OMP_WAIT_POLICY names one."""
    if not engine.startswith("llamacpp"):
        return env
    out = {k: v for k, v in env.items() if k != "OMP_WAIT_POLICY"}
    policy = os.environ.get("FLASHMEMORY_BENCH_LLAMACPP_OMP_WAIT_POLICY")
    if policy:
        out["OMP_WAIT_POLICY"] = policy
    return out


class WorkerLauncher:
    """Owns the run folder and the workers' environment; run() is one process per job."""

    def __init__(self, run_dir: Path, num_threads: int, timeout_s: float | None) -> None:
        self.run_dir = run_dir
        self.env = worker_env(num_threads)
        self.timeout_s = timeout_s
        self._job_ids = count()

    def run(self, job: SpeedJob | FidelityJob, timeout_s: float | None = None) -> tuple[Any, str | None]:
        """(result, None) on success, (None, reason) when the engine raised, crashed or ran out of time."""
        path = write_job(job, self.run_dir / f"job-{next(self._job_ids)}.json")
        limit = timeout_s if timeout_s is not None else self.timeout_s
        try:
            proc = subprocess.run([sys.executable, "-m", "flashmemory.tools.bench.worker", str(path)], capture_output=True,
                                  text=True, env=engine_env(self.env, getattr(job, "engine", "")), timeout=limit)
        except subprocess.TimeoutExpired:
            return None, f"timed out after {limit:.0f} s"
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
        if not lines:
            return None, _crash_reason(proc.returncode, proc.stderr)
        payload = json.loads(lines[-1][len(RESULT_PREFIX):])
        if payload["ok"]:
            return payload["result"], None
        return None, payload["error"]


def _crash_reason(returncode: int, stderr: str) -> str:
    if returncode < 0:
        name = signal.Signals(-returncode).name
        hint = " (out of memory?)" if -returncode == signal.SIGKILL else ""
        return f"worker killed by {name}{hint}"
    tail = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    return f"worker exited with status {returncode}: {tail[-1] if tail else 'no message'}"
