"""`python -m flashmemory.serve` / `flashmemory serve`: the seed's flags, every engine knob, FLASHMEMORY_* variables."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from flashmemory.cli import main as cli_main
from flashmemory.config import EngineConfig
from flashmemory.errors import ConfigError
from flashmemory.serve.args import add_serve_args, check_env_errors, engine_kwargs, server_config
from tests.serve.conftest import free_port

FLAG_DESTS = {"num_threads": "threads"}  # EngineConfig field -> flag dest where they differ


def parse(argv: list[str], environ: dict[str, str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_args(parser, environ=environ or {})
    return parser.parse_args(argv)


def test_every_engine_setting_is_a_flag():
    parser = argparse.ArgumentParser()
    add_serve_args(parser, environ={})
    dests = {a.dest for a in parser._actions}
    for field in EngineConfig.__dataclass_fields__:
        assert FLAG_DESTS.get(field, field) in dests, field


def test_the_seeds_command_line_is_accepted():
    args = parse(["--model-path", "m.gguf", "--host", "127.0.0.1", "--port", "8000", "--max-gpu-memory-mb", "3200",
                  "--max-seq-len", "131072", "--enable-streaming", "--log-level", "WARNING"])
    kwargs = engine_kwargs(args)
    assert kwargs["model_path"] == "m.gguf" and kwargs["max_gpu_memory_mb"] == 3200
    assert kwargs["max_seq_len"] == 131072
    config = server_config(args, args.serve_log_level)
    assert (config.host, config.port, config.enable_streaming) == ("127.0.0.1", 8000, True)


def test_kv_knobs_reach_the_engine_config():
    args = parse(["tiny/", "--kv-precision", "int4", "--active-window", "64", "--warm-tokens", "128",
                  "--semantic-truncate-threshold", "0.3", "--warm-budget-tokens", "256", "--cpu-memory-gb", "1.5",
                  "--no-cold-zone", "--cold-zone-dir", "/tmp/x", "--block-size", "32", "--prefill-chunk-tokens",
                  "128", "--selection", "exact", "--max-num-seqs", "3", "--threads", "2"])
    kwargs = engine_kwargs(args)
    config = EngineConfig.from_kwargs(**kwargs)
    assert (config.model_path, config.kv_precision, config.active_window, config.warm_tokens) == \
        ("tiny/", "int4", 64, 128)
    assert (config.semantic_truncate_threshold, config.warm_budget_tokens, config.cpu_memory_gb) == (0.3, 256, 1.5)
    assert (config.cold_zone_enabled, config.cold_zone_dir, config.block_size) == (False, "/tmp/x", 32)
    assert (config.prefill_chunk_tokens, config.selection, config.max_num_seqs, config.num_threads) == \
        (128, "exact", 3, 2)
    assert engine_kwargs(parse([]))["max_num_seqs"] == 16  # the server's default


def test_environment_variables_set_every_flag_and_the_command_line_wins():
    env = {"FLASHMEMORY_PORT": "9001", "FLASHMEMORY_HOST": "localhost", "FLASHMEMORY_API_KEY": "k",
           "FLASHMEMORY_KV_PRECISION": "fp16", "FLASHMEMORY_COLD_ZONE_ENABLED": "false",
           "FLASHMEMORY_ENABLE_STREAMING": "0", "FLASHMEMORY_MAX_GPU_MEMORY_MB": "512",
           "FLASHMEMORY_MODEL_PATH": "env.gguf", "FLASHMEMORY_LOG_LEVEL": "debug", "FLASHMEMORY_MAX_N": "2"}
    args = parse([], env)
    check_env_errors(args)
    config = server_config(args, args.serve_log_level)
    kwargs = engine_kwargs(args)
    assert (config.port, config.host, config.api_key, config.enable_streaming, config.max_n) == \
        (9001, "localhost", "k", False, 2)
    assert (kwargs["kv_precision"], kwargs["cold_zone_enabled"], kwargs["max_gpu_memory_mb"]) == ("fp16", False, 512)
    assert kwargs["model_path"] == "env.gguf" and args.serve_log_level == "debug"
    args = parse(["--port", "9002", "--kv-precision", "int4", "--enable-streaming"], env)
    assert (args.port, args.kv_precision, args.enable_streaming) == (9002, "int4", True)


@pytest.mark.parametrize(("name", "value"), [("FLASHMEMORY_PORT", "eighty"), ("FLASHMEMORY_KV_PRECISION", "int3"),
                                             ("FLASHMEMORY_COLD_ZONE_ENABLED", "maybe")])
def test_a_bad_environment_variable_is_a_clear_error(name, value):
    args = parse([], {name: value})
    with pytest.raises(ConfigError, match=name):
        check_env_errors(args)


def test_flashmemory_serve_has_the_same_flags(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["serve", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--model-path", "--host", "--port", "--api-key", "--allow-unauthenticated", "--enable-streaming",
                 "--max-gpu-memory-mb", "--max-seq-len", "--log-level", "--kv-precision", "--no-cold-zone",
                 "--max-num-seqs", "FLASHMEMORY_"):
        assert flag in out, flag


def test_a_missing_model_fails_before_the_server_binds(capsys):
    rc = cli_main(["serve", "/no/such/model", "--port", str(free_port())])
    assert rc == 1 and "does not exist" in capsys.readouterr().err


def test_a_cold_zone_over_the_free_disk_fails_before_the_server_binds(monkeypatch, capsys, tiny_llama):
    from flashmemory.engine import sizing

    monkeypatch.setattr(sizing, "free_disk", lambda folder: sizing.HostFigure(20 * sizing.GIB, "free on the disk"))
    rc = cli_main(["serve", str(tiny_llama), "--cold-zone-gb", "64", "--cpu-memory-gb", "0.01",
                   "--port", str(free_port())])
    err = capsys.readouterr().err
    assert rc == 1 and "cold_zone_gb=64" in err and "20.0 GiB" in err and "Traceback" not in err


def test_python_m_flashmemory_serve_runs_and_stops_cleanly(tiny_llama):
    port = free_port()
    env = {**os.environ, "FLASHMEMORY_SERVED_MODEL_NAME": "from-env", "FLASHMEMORY_PORT": str(port),
           "OMP_NUM_THREADS": "1"}
    # SIGINT at its default in the child: a shell's background job (nohup cmd &) starts with it ignored, and
    # uvicorn re-raises the signal it caught, which an ignored disposition turns into exit status 0.
    proc = subprocess.Popen([sys.executable, "-m", "flashmemory.serve", str(tiny_llama), "--log-level", "warning"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()
        assert models["data"][0]["id"] == "from-env"
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "Alice", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err  # stopped by Ctrl-C (uvicorn re-raises the signal after a graceful shutdown)
    assert "Traceback" not in err
