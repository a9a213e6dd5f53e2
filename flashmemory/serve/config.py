"""ServerConfig: the HTTP server's settings (the engine's are EngineConfig's), validated with the fix in the message."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from flashmemory.errors import ConfigError
from flashmemory.settings import check_settings, setting

DEFAULT_MAX_NUM_SEQS = 16  # the server's default for EngineConfig.max_num_seqs (the Python API's is 4)


@dataclass
class ServerConfig:
    """Settings of one OpenAI-compatible server; each field's Setting holds its help, unit, bounds and flag."""

    host: str = setting("127.0.0.1", "interface to bind; any other than loopback needs --api-key or "
                        "--allow-unauthenticated")
    port: int = setting(8000, "TCP port to listen on", ge=1, le=65535)
    api_key: str | None = setting(
        None, "require 'Authorization: Bearer KEY' on every route but /health; never logged (prefer "
        "FLASHMEMORY_API_KEY: a flag shows in the process list)", repr=False)
    allow_unauthenticated: bool = setting(
        False, "allow a non-loopback --host without an API key (trusted networks only)")
    enable_streaming: bool = setting(True, "allow stream=true (off: a request with stream=true is a 400)",
                                     negatable=True)
    served_model_name: str | None = setting(
        None, "the model id clients send; None = the checkpoint's file or folder name")
    max_body_bytes: int = setting(8 * 2**20, "larger request bodies get 413", unit="bytes", ge=1)
    max_n: int = setting(8, "choices per request (n) at most", ge=1)
    max_tokens_limit: int = setting(4096, "max_tokens at most (also the default for chat, capped by the context)",
                                    unit="tokens", ge=1)
    max_pending_requests: int = setting(256, "sequences accepted and unfinished at once; more get 503", ge=1)
    max_num_batched_tokens: int | None = setting(
        None, "tokens in one forward (decodes and prefill chunks together); None = prefill_chunk_tokens",
        unit="tokens", ge=1)
    shutdown_timeout_s: float = setting(
        30.0, "after SIGTERM or SIGINT, seconds running requests get to finish (new ones get 503); then the rest "
        "end with an error (streams: an error chunk and [DONE]) and the server exits", unit="seconds", ge=0)
    stats_log_interval_s: float = setting(10.0, "seconds between stats lines (none while idle); 0 = off",
                                          unit="seconds", ge=0)
    # NOTE: no choices: the flag takes any case ("WARNING"), checked below.
    log_level: str = setting("info", "debug, info, warning, error or critical (trace: also uvicorn's details)",
                             dest="serve_log_level")

    def __post_init__(self) -> None:
        check_settings(self)  # types, bounds and choices, as each field's Setting declares them
        if self.api_key is not None and len(self.api_key) == 0:
            raise ConfigError("api_key must not be empty (omit it to run without a key)")
        if self.log_level.lower() not in ("critical", "error", "warning", "info", "debug", "trace"):
            raise ConfigError(f"log_level={self.log_level!r}: use debug, info, warning, error or critical")
        if self.api_key is None and not self.allow_unauthenticated and not is_loopback(self.host):
            raise ConfigError(
                f"refusing to listen on {self.host} without an API key: anyone who can reach it could use the model. "
                "Set --api-key (or FLASHMEMORY_API_KEY), bind 127.0.0.1, or pass --allow-unauthenticated on a "
                "trusted network")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything
