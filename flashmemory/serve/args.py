"""Command-line flags of the server (shared by `python -m flashmemory.serve` and `flashmemory serve`), generated from
ServerConfig and EngineConfig, each also settable by a FLASHMEMORY_* environment variable (the command line wins)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any

from flashmemory.config_args import (
    add_engine_flags,
    add_flags,
    add_kv_flags,
    apply_env_defaults,
    check_env_errors,
    config_kwargs,
    dataclass_defaults,
)
from flashmemory.config_args import engine_kwargs as flag_engine_kwargs
from flashmemory.errors import ConfigError
from flashmemory.serve.config import DEFAULT_MAX_NUM_SEQS, ServerConfig

__all__ = ["add_serve_args", "check_env_errors", "engine_kwargs", "server_config"]


def add_serve_args(p: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """The server's flags, the engine's (model, device, dtype, context) and the KV knobs; defaults from the
    environment."""
    p.add_argument("model", nargs="?", default=None, help="GGUF file or HF safetensors folder (default: embedded "
                   "SmolLM2); same as --model-path")
    server_defaults = dataclass_defaults(ServerConfig)  # in the namespace even when not given, as before
    flags = add_flags(p, ServerConfig, list(server_defaults), "server", server_defaults)
    flags += add_engine_flags(p)
    flags += add_kv_flags(p, defaults={"max_num_seqs": DEFAULT_MAX_NUM_SEQS})
    apply_env_defaults(p, flags, os.environ if environ is None else environ)


def server_config(args: argparse.Namespace, log_level: str) -> ServerConfig:
    return ServerConfig(**{**config_kwargs(args, ServerConfig), "log_level": log_level})


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """FlashMemoryEngine keywords from the flags (the KV knobs only where set; max_num_seqs has a server default)."""
    kwargs = flag_engine_kwargs(args)
    if args.model is not None and kwargs.get("model_path") not in (None, args.model):
        raise ConfigError(f"two models given ({args.model!r} and --model-path {kwargs['model_path']!r}); give one")
    kwargs["model_path"] = args.model or kwargs.get("model_path")
    return kwargs
