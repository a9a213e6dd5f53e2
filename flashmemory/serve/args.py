"""Command-line flags of the server (shared by `python -m flashmemory.serve` and `flashmemory serve`), each also
settable by a FLASHMEMORY_* environment variable named after it (the command line wins)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any

from flashmemory.errors import ConfigError
from flashmemory.serve.config import DEFAULT_MAX_NUM_SEQS, ServerConfig

ENV_PREFIX = "FLASHMEMORY_"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_ENV_NAMES = {"serve_log_level": "LOG_LEVEL"}  # dest -> variable suffix where the dest name differs


def add_serve_args(p: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """The server's flags, the engine's (device, dtype, context) and the KV knobs; defaults from the environment."""
    from flashmemory.cli import add_engine_args, add_kv_args

    d = ServerConfig()
    p.add_argument("model", nargs="?", default=None, help="GGUF file or HF safetensors folder (default: embedded "
                   "SmolLM2); same as --model-path")
    p.add_argument("--model-path", "--model", dest="model_path", default=None, help="the model (seed's spelling)")
    s = p.add_argument_group("server")
    s.add_argument("--host", default=d.host, help=f"interface to bind ({d.host}); any other than loopback needs "
                   "--api-key or --allow-unauthenticated")
    s.add_argument("--port", type=int, default=d.port)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health "
                   "(prefer FLASHMEMORY_API_KEY: a flag shows in the process list)")
    s.add_argument("--allow-unauthenticated", action="store_true", default=False,
                   help="allow a non-loopback --host without an API key (trusted networks only)")
    s.add_argument("--enable-streaming", action=argparse.BooleanOptionalAction, default=d.enable_streaming,
                   help="allow stream=true (on by default; --no-enable-streaming makes it a 400)")
    s.add_argument("--served-model-name", default=None, help="model id clients send (default: the file's name)")
    s.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, help="larger request bodies get 413")
    s.add_argument("--max-n", type=int, default=d.max_n, help="most choices per request")
    s.add_argument("--max-tokens-limit", type=int, default=d.max_tokens_limit, help="most tokens per completion")
    s.add_argument("--max-pending-requests", type=int, default=d.max_pending_requests,
                   help="sequences accepted and unfinished at once; more get 503")
    s.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per forward, decodes and prefill chunks together (default: --prefill-chunk-tokens)")
    s.add_argument("--stats-log-interval-s", type=float, default=d.stats_log_interval_s,
                   help="seconds between stats lines (quiet while idle; 0 = off)")
    s.add_argument("--log-level", dest="serve_log_level", default=None, help="debug, info (default), warning, error")
    add_engine_args(p)
    add_kv_args(p)
    apply_env_defaults(p, os.environ if environ is None else environ)


def env_name(dest: str) -> str:
    return ENV_PREFIX + _ENV_NAMES.get(dest, dest.upper())


def apply_env_defaults(p: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """Take FLASHMEMORY_<DEST> as the default of each flag (FLASHMEMORY_PORT, FLASHMEMORY_COLD_ZONE_ENABLED, ...)."""
    defaults: dict[str, Any] = {}
    errors: list[str] = []  # reported by check_env_errors when the command runs, not while building the parser
    for action in p._actions:  # argparse offers no public iterator over its actions
        if not action.option_strings or action.dest in ("help",):
            continue
        raw = environ.get(env_name(action.dest))
        if raw is None:
            continue
        try:
            defaults[action.dest] = _env_value(action, env_name(action.dest), raw)
        except ConfigError as e:
            errors.append(str(e))
    p.set_defaults(**defaults, env_errors=errors)


def check_env_errors(args: argparse.Namespace) -> None:
    errors = getattr(args, "env_errors", [])
    if errors:
        raise ConfigError("; ".join(errors))


def _env_value(action: argparse.Action, name: str, raw: str) -> Any:
    if action.nargs == 0:  # a switch: store_true, store_const (--no-cold-zone), --[no-]enable-streaming
        flag = raw.strip().lower()
        if flag not in _TRUE + _FALSE:
            raise ConfigError(f"{name}={raw!r}: use 1/0, true/false, yes/no or on/off")
        return flag in _TRUE
    try:
        value = action.type(raw) if callable(action.type) else raw
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a valid {getattr(action.type, '__name__', 'value')}") from None
    if action.choices is not None and value not in action.choices:
        raise ConfigError(f"{name}={raw!r}: use one of {', '.join(map(str, action.choices))}")
    return value


def server_config(args: argparse.Namespace, log_level: str) -> ServerConfig:
    return ServerConfig(
        host=args.host, port=args.port, api_key=args.api_key, allow_unauthenticated=args.allow_unauthenticated,
        enable_streaming=args.enable_streaming, served_model_name=args.served_model_name,
        max_body_bytes=args.max_body_bytes, max_n=args.max_n, max_tokens_limit=args.max_tokens_limit,
        max_pending_requests=args.max_pending_requests, max_num_batched_tokens=args.max_num_batched_tokens,
        stats_log_interval_s=args.stats_log_interval_s, log_level=log_level,
    )


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """FlashMemoryEngine keywords from the flags (the KV knobs only where set; max_num_seqs has a server default)."""
    from flashmemory.cli import kv_kwargs

    if args.model is not None and args.model_path is not None and args.model != args.model_path:
        raise ConfigError(f"two models given ({args.model!r} and --model-path {args.model_path!r}); give one")
    kwargs = dict(model_path=args.model or args.model_path, device=args.device, dtype=args.dtype,
                  max_seq_len=args.max_seq_len, num_threads=args.threads, **kv_kwargs(args))
    kwargs.setdefault("max_num_seqs", DEFAULT_MAX_NUM_SEQS)
    return kwargs
