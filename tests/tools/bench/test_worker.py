"""The worker protocol: an engine's error comes back as that engine's reason; a crash is told apart."""

from __future__ import annotations

import json
import signal

from flashmemory.tools.bench.jobs import SpeedJob, write_job
from flashmemory.tools.bench.launcher import _crash_reason, worker_env
from flashmemory.tools.bench.worker import RESULT_PREFIX, main


def test_an_engine_error_is_returned_as_the_reason(tiny_llama, tmp_path, capsys):
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(list(range(50))))
    job = SpeedJob("fm-x", "flashmemory", {"kv_precision": "int3"}, str(tiny_llama), None, str(ids), 32, 4,
                   "float32", 1)
    assert main([str(write_job(job, tmp_path / "job.json"))]) == 0
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(RESULT_PREFIX)][-1]
    payload = json.loads(line[len(RESULT_PREFIX):])
    assert payload["ok"] is False and payload["error"].startswith("ConfigError: kv_precision='int3'")


def test_a_crash_is_reported_by_signal_or_last_stderr_line():
    assert _crash_reason(-signal.SIGKILL, "") == "worker killed by SIGKILL (out of memory?)"
    assert _crash_reason(-signal.SIGSEGV, "") == "worker killed by SIGSEGV"
    reason = _crash_reason(1, "Traceback (most recent call last):\n  ...\nImportError: libfoo.so\n\n")
    assert reason == "worker exited with status 1: ImportError: libfoo.so"


def test_workers_wait_passively_with_the_thread_count_given(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    env = worker_env(3)
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and env["OMP_NUM_THREADS"] == "3"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # an explicit choice is respected
    assert worker_env(1)["OMP_WAIT_POLICY"] == "ACTIVE"


def test_llama_cpp_workers_keep_openmps_default_wait_policy(monkeypatch):
    """PASSIVE turns each of ggml's per-node barriers into a sleep; llama.cpp runs best with OpenMP's default."""
    from flashmemory.tools.bench.engines import LLAMA_CPP

    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    env = worker_env(2, LLAMA_CPP)
    assert "OMP_WAIT_POLICY" not in env and env["OMP_NUM_THREADS"] == "2"


def test_the_llama_cpp_worker_does_not_load_torch():
    """Its peak RSS must be llama.cpp's own: importing the worker's modules leaves torch out of the process."""
    import subprocess
    import sys

    code = ("import sys, flashmemory.tools.bench.worker, flashmemory.tools.bench.llamacpp_worker, "
            "flashmemory.tools.bench.decode_worker; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
