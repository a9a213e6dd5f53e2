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

from flashmemory.tools.bench.engines import LLAMA_CPP
from flashmemory.tools.bench.jobs import FidelityJob, SpeedJob, write_job
from flashmemory.tools.bench.worker import RESULT_PREFIX


def worker_env(num_threads: int, family: str = "") -> dict[str, str]:
    """The environment of a worker: the same thread count for every engine's OpenMP pool, this very copy of the
    package on the path, and each engine's best wait policy: passive for the torch engines (their spinning
    OpenMP threads lose 10x on a shared machine), OpenMP's default for llama.cpp (passive turns each of ggml's
    per-node barriers into a sleep: its 2 threads then run slower than 1)."""
    package_root = str(Path(__file__).resolve().parents[3])  # the folder holding flashmemory/
    path = os.environ.get("PYTHONPATH", "")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if family != LLAMA_CPP:
        env["OMP_WAIT_POLICY"] = os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
    return {
        **env,
        "OMP_NUM_THREADS": str(num_threads),
        "MKL_NUM_THREADS": str(num_threads),
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": package_root + (os.pathsep + path if path else ""),
    }


class WorkerLauncher:
    """Owns the run folder and the workers' environment; run() is one process per job."""

    def __init__(self, run_dir: Path, num_threads: int, timeout_s: float | None) -> None:
        self.run_dir = run_dir
        self.num_threads = num_threads
        self.timeout_s = timeout_s
        self._job_ids = count()

    def run(self, job: SpeedJob | FidelityJob, timeout_s: float | None = None) -> tuple[Any, str | None]:
        """(result, None) on success, (None, reason) when the engine raised, crashed or ran out of time."""
        path = write_job(job, self.run_dir / f"job-{next(self._job_ids)}.json")
        limit = timeout_s if timeout_s is not None else self.timeout_s
        try:
            proc = subprocess.run([sys.executable, "-m", "flashmemory.tools.bench.worker", str(path)], capture_output=True,
                                  text=True, env=worker_env(self.num_threads, job.family), timeout=limit)
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
