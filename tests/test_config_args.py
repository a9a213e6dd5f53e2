"""Flags and FLASHMEMORY_* variables generated from the Settings: every field reachable from `flashmemory generate`
and the server, unset ones not passed, every field type round-tripped through its variable, bad text named."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from flashmemory.cli import EXIT_ERROR, build_parser, main
from flashmemory.config import EngineConfig
from flashmemory.config_args import engine_kwargs, env_names, option_strings
from flashmemory.errors import ConfigError
from flashmemory.serve.args import add_serve_args, check_env_errors, server_config
from flashmemory.serve.args import engine_kwargs as serve_engine_kwargs
from flashmemory.serve.config import ServerConfig
from flashmemory.settings import field_names, setting_of

PACKAGE = Path(__file__).resolve().parents[1] / "flashmemory"

# A valid value other than the default for every field (together they make one valid config of each class).
ENGINE_SAMPLES = {
    "model_path": "m.gguf", "device": "cpu", "dtype": "float16", "weights_dtype": "q8_0",
    "decode_activations": "float32",
    "max_seq_len": 4096,
    "num_threads": 2,
    "rope_sharding": False,
    "parse_special_tokens_in_content": True,
    # tiered (the default): remote_kv_url below needs it
    "kv_cache": "tiered", "kv_precision": "int4", "kv_quant_range": "minmax",
    "max_gpu_memory_mb": 512,
    "active_window": 64,
    "recent_fp16_tokens": 32,
    "warm_tokens": 128, "semantic_truncate_threshold": 0.3, "warm_budget_tokens": 256, "warm_budget_fraction": 0.5,
    "selection_min_tokens": 64,
    "selection_box_tokens": 8,
    "selection_rescore_factor": 2.0, "selection_prompt_tokens": 32, "cpu_memory_gb": 1.5,
    "lock_host_memory": True,
    "cold_zone_enabled": False, "cold_zone_dir": "/tmp/x", "cold_zone_gb": 2.5,
    "kv_levels": "device_memory,host_memory,host_memory:64:int4:0", "block_size": 32,
    "prefill_chunk_tokens": 128, "selection": "exact", "max_num_seqs": 3, "record_traces": True,
    "prefetch_strategy": "adaptive", "prefetch_ranker": "lru", "prefetch_budget_mb": 32.0,
    "heat_predictor_path": "/tmp/h.npz", "cold_zone_uncached_reads": True, "device_staging_mb": 8.0,
    "prefix_caching": False, "prefix_cache_host_mb": 16.0, "prefix_cache_disk_mb": 256.0, "persist_cache": True, "attention_backend": "torch",
    "scheduling_policy": "fcfs",
    "placement_policy": "locality", "locality_device_tokens": 512, "locality_host_tokens": 1024,
    "locality_history_steps": 50,
    "budget_controller": True, "budget_controller_min_fraction": 0.75,
    "remote_kv_url": "redis://127.0.0.1:6390/1", "remote_kv_namespace": "team-a",
    "remote_kv_ttl_s": 600, "remote_kv_max_mb": 64, "remote_kv_timeout_ms": 250.0,
    "remote_kv_required": True,
    "speculative_method": "draft", "draft_model_path": "d.gguf", "num_speculative_tokens": 3,
    "speculative_adaptive": False, "speculative_cost_aware": False, "prompt_lookup_max": 5,
    "prompt_lookup_min": 3,
    "guardrail_path": "toxic-comment-classifier",
    "guardrail_precision": "float32", "guardrail_timeout_ms": 80.0, "guardrail_threshold": 0.7,
    "guardrail_chunk_tokens": 8, "guardrail_on_error": "block", "guardrail_threads": 2,
}
SERVER_SAMPLES = {
    "host": "localhost", "port": 9001, "api_key": "k", "allow_unauthenticated": True, "enable_streaming": False,
    "served_model_name": "tiny", "max_body_bytes": 1024, "max_n": 2, "max_tokens_limit": 64,
    "max_pending_requests": 4, "max_num_batched_tokens": 256, "shutdown_timeout_s": 2.5,
    "stats_log_interval_s": 0.5, "log_level": "debug",
}
SAMPLES = {EngineConfig: ENGINE_SAMPLES, ServerConfig: SERVER_SAMPLES}
FIELDS = [(cls, name) for cls in SAMPLES for name in field_names(cls)]


def argv_for(cls: type, name: str, value: object) -> list[str]:
    flag = option_strings(cls, name)[0]
    if isinstance(value, bool):
        if setting_of(cls, name).negatable:
            return [flag if value else f"--no-{flag[2:]}"]
        return [flag]  # a switch: the samples are the value it sets
    return [flag, str(value)]


def all_argv(cls: type) -> list[str]:
    return [arg for name, value in SAMPLES[cls].items() for arg in argv_for(cls, name, value)]


def serve_parse(argv: list[str], environ: dict[str, str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_args(parser, environ=environ or {})
    return parser.parse_args(argv)


def test_the_samples_cover_every_setting():
    for cls, samples in SAMPLES.items():
        assert list(samples) == field_names(cls)
        cls(**samples)  # and make a valid config


def test_every_engine_setting_is_a_flag_of_generate():
    args = build_parser().parse_args(["generate", *all_argv(EngineConfig)])
    assert engine_kwargs(args) == ENGINE_SAMPLES


def test_every_engine_and_server_setting_is_a_flag_of_the_server():
    args = serve_parse([*all_argv(EngineConfig), *all_argv(ServerConfig)])
    assert serve_engine_kwargs(args) == ENGINE_SAMPLES
    assert dataclasses.asdict(server_config(args, args.serve_log_level)) == SERVER_SAMPLES


def test_settings_not_given_are_not_passed_so_the_defaults_apply():
    assert engine_kwargs(build_parser().parse_args(["generate"])) == {}
    assert serve_engine_kwargs(serve_parse([])) == {"model_path": None, "max_num_seqs": 16}
    assert server_config(serve_parse([]), "info") == ServerConfig()


def env_text(value: object) -> str:
    return ("true" if value else "0") if isinstance(value, bool) else str(value)


@pytest.mark.parametrize(("cls", "name"), FIELDS, ids=[f"{c.__name__}.{n}" for c, n in FIELDS])
def test_every_setting_round_trips_through_its_environment_variable(cls, name):
    value = SAMPLES[cls][name]
    args = serve_parse([], {env_names(cls, name)[0]: env_text(value)})
    check_env_errors(args)
    if cls is EngineConfig:
        assert serve_engine_kwargs(args)[name] == value
    else:
        assert getattr(server_config(args, args.serve_log_level), name) == value


@pytest.mark.parametrize(("environ", "name", "value"), [
    ({"FLASHMEMORY_BLOCK_SIZE": "auto"}, "block_size", "auto"),
    ({"FLASHMEMORY_BLOCK_SIZE": "64"}, "block_size", 64),
    ({"FLASHMEMORY_COLD_ZONE_ENABLED": "on"}, "cold_zone_enabled", True),
    ({"FLASHMEMORY_RECORD_TRACES": "no"}, "record_traces", False),
    ({"FLASHMEMORY_THREADS": "3"}, "num_threads", 3),
    ({"FLASHMEMORY_NUM_THREADS": "3", "FLASHMEMORY_THREADS": "3"}, "num_threads", 3),
])
def test_environment_spellings_reach_the_engine(environ, name, value):
    args = serve_parse([], environ)
    check_env_errors(args)
    assert serve_engine_kwargs(args)[name] == value


def test_the_command_line_wins_over_every_kind_of_variable():
    env = {"FLASHMEMORY_BLOCK_SIZE": "auto", "FLASHMEMORY_NUM_THREADS": "3", "FLASHMEMORY_MAX_SEQ_LEN": "64",
           "FLASHMEMORY_CPU_MEMORY_GB": "9", "FLASHMEMORY_ENABLE_STREAMING": "false"}
    args = serve_parse(["--block-size", "8", "--threads", "1", "--max-seq-len", "128", "--cpu-memory-gb", "2",
                        "--enable-streaming"], env)
    kwargs = serve_engine_kwargs(args)
    assert (kwargs["block_size"], kwargs["num_threads"], kwargs["max_seq_len"], kwargs["cpu_memory_gb"]) == \
        (8, 1, 128, 2.0)
    assert args.enable_streaming is True


@pytest.mark.parametrize(("environ", "match"), [
    ({"FLASHMEMORY_BLOCK_SIZE": "12x"}, "FLASHMEMORY_BLOCK_SIZE='12x': use 'auto' or a number"),
    ({"FLASHMEMORY_CPU_MEMORY_GB": "lots"}, "FLASHMEMORY_CPU_MEMORY_GB='lots' is not a valid float"),
    ({"FLASHMEMORY_RECORD_TRACES": "sometimes"}, "FLASHMEMORY_RECORD_TRACES='sometimes': use 1/0"),
    ({"FLASHMEMORY_SELECTION": "random"}, "FLASHMEMORY_SELECTION='random': use one of quest, exact"),
    ({"FLASHMEMORY_NUM_THREADS": "2", "FLASHMEMORY_THREADS": "4"}, "disagree; set only FLASHMEMORY_NUM_THREADS"),
])
def test_a_bad_variable_is_a_config_error_naming_it_when_the_command_runs(environ, match):
    args = serve_parse([], environ)  # building the parser does not raise
    with pytest.raises(ConfigError, match=match):
        check_env_errors(args)


def test_a_bad_block_size_flag_is_a_clear_error(capsys):
    assert main(["generate", "--prompt", "hi", "--block-size", "12x"]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert err.startswith("error: --block-size '12x': use 'auto' or a number") and "Traceback" not in err


def test_eval_takes_the_engine_flags_it_uses():
    args = build_parser().parse_args(["eval", "--model", "m.gguf", "--dtype", "bf16", "--threads", "2"])
    assert engine_kwargs(args) == {"model_path": "m.gguf", "dtype": "bf16", "num_threads": 2}


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_only_the_entry_point_imports_the_cli():
    importers = [p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
                 if "flashmemory.cli" in imported_modules(p)]
    assert importers == ["__main__.py"]


def test_the_server_flags_load_without_the_cli():
    code = ("import sys, flashmemory.serve.launcher, flashmemory.config_args, flashmemory.tools.config_doc; "
            "assert 'flashmemory.cli' not in sys.modules, 'flashmemory.cli was imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=PACKAGE.parent)
    assert proc.returncode == 0, proc.stderr
