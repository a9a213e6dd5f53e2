"""MATS-3, endurance: a real server under a steady mixed load for the whole duration, watched for drift.

The server is `python -m flashmemory.serve` on a free loopback port (the embedded SmolLM2 unless a model is given)
with a small window and warm span, so long prompts use all three KV levels. After a first request sets the
baseline, client threads (traffic.py) keep it busy until the time is up; then it is left idle. The report gives
latency per time window (TTFT and inter-token p50 / p90; first vs last window), the server's RSS at the first
request, at the end of the load and after idling (pass: within 10 % of the first-request level after at least
640 requests), the cold-zone folder's allocated bytes at the same points, the KV blocks still held when idle
(must be 0), the 5xx count (must be 0: no request is designed to fail with one), and, on a GPU host, temperature,
clocks and ECC counters through NVML.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from flashmemory.tools.mats.endurance_report import build_report
from flashmemory.tools.mats.endurance_run import EnduranceRun
from flashmemory.tools.mats.gpu_watch import GpuWatch
from flashmemory.tools.mats.options import MatsOptions
from flashmemory.tools.mats.report import SuiteReport
from flashmemory.tools.mats.server_process import ServerProcess

# A small window and warm span: long prompts (a few hundred tokens) reach L1 and L2. Flags given with --server-arg
# come after these, so they win.
DEFAULT_SERVER_ARGS = ["--active-window", "64", "--warm-tokens", "128"]


def run_endurance(options: MatsOptions) -> SuiteReport:
    """Run MATS-3: start a server, load it for options.duration_s seconds, idle it, report the drift."""
    gpu, gpu_skipped = GpuWatch.open()
    with tempfile.TemporaryDirectory(prefix="flashmemory-mats-", dir=options.workdir) as folder:
        server = ServerProcess(options.model, DEFAULT_SERVER_ARGS + list(options.server_args),
                               Path(folder) / "cold-zone", Path(folder) / "server.log")
        run = EnduranceRun(server, options)
        try:
            run.start()
            if gpu is not None:
                gpu.start()
            run.load()
            run.idle()
        except Exception as e:  # noqa: BLE001 - the server failed to start or answer: reported, never a traceback
            run.failure = f"{type(e).__name__}: {e}"
        finally:
            gpu_summary = gpu.stop() if gpu is not None else None
            run.exit_status = server.stop()
            run.log_tail = server.log_tail()
    return build_report(options, run, gpu_summary, gpu_skipped)
